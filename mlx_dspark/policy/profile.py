"""Cost profile for the scheduler: target step rate and drafter cost per block.

The profile is measured once per (backend/device, target, quantization,
drafter, mlx version) and cached as JSON in the user cache; ``refresh``
re-measures. Identities are fingerprints of the models (config, tensor names,
shapes, dtypes and a few weight values), so a profile is never reused for a
different model, and no file path is needed.

A measurement taken while other processes ran can contradict itself (a
forward over 6 tokens slower than one over 9, a drafting pass dearer than
verifying the whole block): :func:`contradiction` says so, and such a profile
is measured again, cached or fresh; the two measurements are combined size by
size (the faster; other load only ever adds time). One that still
contradicts itself is kept, marked, and not measured again.

What a run measures is written back (:func:`save_measured`: the default
policy when a generation ends, the server when a request finishes), so that
the next process starts from it rather than from the first measurement:

* what is merged: the verify cost of each query length the profile holds,
  the drafter's own drafting pass, and a plain round (the loop's pipelined
  step, kept as ``meta["plain_seconds"]``), each as the median of its recent
  measurements in the run;
* the rule: a cost measured in fewer than ``LEAST_ROUNDS`` rounds of a run
  counts as not measured. A query length the run did not measure moves as
  the run priced it (:mod:`~mlx_dspark.policy.costs`): by the measured-to-
  stored ratio interpolated in log space between the nearest measured
  lengths, weighing the fewer rounds of those, so a profile wrong by a factor
  is corrected everywhere and keeps its shape. Each cost is blended in log
  space, the stored one weighing ``PROFILE_WEIGHT`` rounds plus the rounds
  runs merged into it before (at most ``MOST_WEIGHT``, so the profile keeps
  following the machine), the run its rounds (at most ``RUN_WEIGHT``), and
  the run's cost counts as at most ``RUN_FACTOR`` times off the stored one. So
  a few noisy rounds move a cost little, one run at most two thirds of the
  way (in log space), and runs that agree take over;
* what is never written: a profile that is absent (nothing measured it, or
  the caller chose none), unreadable or corrupt (left for :func:`get_profile`
  to measure again), keyed for another pair or machine, marked read-only
  (no write permission bit), or one that contradicts itself and was not
  measured again (:func:`trusted`); nor a merge that would contradict itself
  when the stored profile did not. The file is replaced by renaming a whole
  one over it (:func:`~mlx_dspark.utils.write_text_atomic`); a failed write
  leaves it as it was. ``refresh`` measures the profile anew and forgets what
  runs merged into it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import DSparkError
from ..proposers.base import Round
from ..proposers.copying import Drafter, own_proposer
from ..sampling.processing import SamplingParams
from ..targets.adapter import TargetAdapter
from ..utils import cache_dir, write_text_atomic
from .costs import MeasuredCosts
from .scheduler import StepRateCurve

PROFILE_VERSION = 2
DEFAULT_CONTEXTS = (64, 256)
# A forward over more tokens does the same work and more. BLAS picks other
# kernels at some sizes, so a longer one may come out a little faster, not
# this many times faster.
LONGER_FASTER = 1.5
# Writing a run's measurements back (see the module's notes).
LEAST_ROUNDS = 3
PROFILE_WEIGHT = 8
MOST_WEIGHT = 64
RUN_WEIGHT = 16
RUN_FACTOR = 4.0


def _digest(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def model_fingerprint(model: nn.Module, config: dict | None = None) -> str:
    """Identity of a model: config, tensor layout and a sample of its values."""
    params = tree_flatten(model.parameters())
    layout = [(name, tuple(v.shape), str(v.dtype)) for name, v in params]
    samples = []
    for _, value in params[:: max(1, len(params) // 8)][:8]:
        head = value.reshape(-1)[:32].astype(mx.float32)
        samples.append(np.round(np.array(head), 5).tolist())
    return _digest([config or {}, layout, samples])


def quantization_of(model: nn.Module) -> str:
    """``"bits/group_size"`` of a quantized model, ``"none"`` otherwise."""
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if bits is not None and hasattr(module, "group_size"):
            return f"{bits}/{module.group_size}"
    return "none"


def _target_config(model: nn.Module) -> dict:
    args = getattr(model, "args", None)
    if args is None:
        return {}
    try:
        from dataclasses import asdict

        return asdict(args)
    except TypeError:
        return dict(vars(args))


def device_identity() -> str:
    from ..machine import backend

    device = mx.default_device()
    name = ""
    try:
        name = str(mx.device_info().get("device_name", ""))
    except Exception:
        pass
    return f"{backend()}:{device}:{name}"


def profile_key(model: nn.Module, drafter: Drafter) -> dict:
    """Everything a cached profile must match."""
    return {
        "version": PROFILE_VERSION,
        "device": device_identity(),
        "target": model_fingerprint(model, _target_config(model)),
        "quantization": quantization_of(model),
        "drafter": model_fingerprint(drafter, drafter.config.to_dict()),
        "mlx": mx.__version__,
    }


def profile_path(key: dict) -> Path:
    return cache_dir() / "profiles" / f"{_digest([key])}.json"


def cached_profile_path(model: nn.Module, drafter: Drafter) -> str | None:
    """The file this pair's profile is cached in on this machine, if it is."""
    path = profile_path(profile_key(model, drafter))
    return str(path) if path.is_file() else None


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return float(np.median(times))


def measure_profile(
    target: TargetAdapter,
    drafter: Drafter,
    n_max: int | None = None,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> StepRateCurve:
    """Seconds per target forward at 1..n_max+1 query tokens and per drafting
    round (a committed token taken in, a block drafted), at each context
    length; the curve averages over the contexts.
    ``progress(done, total)`` follows every measurement."""
    n_max = drafter.block_size if n_max is None else n_max
    proposer = own_proposer(drafter)
    sizes = list(range(1, n_max + 2))
    vocab = target.vocab_size
    rng = np.random.default_rng(0)
    per_context: dict[int, dict[int, float]] = {}
    draft_times: dict[int, float] = {}
    total = len(contexts) * (len(sizes) + 1)
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    for context in contexts:
        prompt = mx.array(rng.integers(0, vocab - 1, context))
        cache = target.make_cache()
        logits, features = target(prompt[None], cache)
        mx.eval(logits, features)
        timings = {}
        for size in sizes:
            tokens = mx.array(rng.integers(0, vocab - 1, (1, size)))

            def forward(tokens=tokens, size=size, cache=cache):
                out = target(tokens, cache)
                mx.eval(out)
                target.rollback(cache, size)

            forward()  # warm-up
            timings[size] = _median_time(forward, repeats)
            advance()
        per_context[context] = timings
        # A round's proposer takes in the features of the tokens committed
        # since the last round (here one) and drafts a block: it does not
        # take in the whole context again.
        tokens = prompt.tolist()
        primed = proposer.make_state()
        kv = partial(target.attention_kv, cache)  # read by a Gemma-4 assistant
        first = Round(tokens, features[:, :-1], 1, SamplingParams(), None, target_kv=kv)
        proposer.propose(primed, first)
        mx.eval(primed.arrays())
        round = Round(
            [*tokens, tokens[-1]],
            features[:, -1:],
            drafter.block_size,
            SamplingParams(),
            None,
            target_kv=kv,
        )

        def draft(primed=primed, round=round):
            # A copy of the primed state: a round changes it.
            state = primed.copy()
            proposal = proposer.propose(state, round)
            mx.eval(
                [a for a in (proposal.tokens, proposal.confidence) if a is not None]
            )

        draft()
        draft_times[context] = _median_time(draft, repeats)
        advance()
    seconds = {
        size: float(np.mean([per_context[c][size] for c in contexts])) for size in sizes
    }
    meta = {
        "contexts": list(contexts),
        "step_seconds_by_context": {
            str(c): {str(s): t for s, t in v.items()} for c, v in per_context.items()
        },
        "draft_seconds_by_context": {str(c): t for c, t in draft_times.items()},
    }
    return StepRateCurve.from_measurements(
        seconds, float(np.mean(list(draft_times.values()))), meta
    )


def load_profile(
    model: nn.Module, drafter: Drafter, n_max: int = 0
) -> StepRateCurve | None:
    """The cached profile for this pair on this machine, or None (also when it
    was not measured as far as verifying ``n_max`` drafts)."""
    key = profile_key(model, drafter)
    path = profile_path(key)
    if not path.is_file():
        return None
    try:
        curve = StepRateCurve.load(path)
    except DSparkError:
        return None
    return curve if curve.meta.get("key") == key and reaches(curve, n_max) else None


def contradiction(curve: StepRateCurve) -> str | None:
    """Why a measured profile cannot be this machine's costs, or None."""
    sizes = curve.batch_sizes
    times = [1.0 / s for s in curve.steps_per_second]
    for i in range(len(sizes) - 1):
        j = i + 1 + int(np.argmin(times[i + 1 :]))
        if times[i] > LONGER_FASTER * times[j]:
            return (
                f"a forward over {sizes[i]} tokens measured {times[i] / times[j]:.1f}x "
                f"slower than one over {sizes[j]}"
            )
    if curve.draft_seconds > times[-1]:
        return (
            f"a drafting pass measured {curve.draft_seconds / times[-1]:.1f}x dearer "
            f"than a forward over {sizes[-1]} tokens"
        )
    return None


def trusted(curve: StepRateCurve) -> bool:
    """Whether a cached profile may be used as it is: it does not contradict
    itself, or it did again when measured again."""
    return "remeasured" in curve.meta or contradiction(curve) is None


def fastest_of(first: StepRateCurve, second: StepRateCurve) -> StepRateCurve:
    """Two measurements of one profile combined: at each size, and for
    drafting, the faster (load from other processes only adds time)."""
    rates = dict(zip(first.batch_sizes, first.steps_per_second, strict=True))
    for size, rate in zip(second.batch_sizes, second.steps_per_second, strict=True):
        rates[size] = max(rate, rates.get(size, 0.0))
    draft = min(first.draft_seconds, second.draft_seconds)
    return StepRateCurve(list(rates), list(rates.values()), draft, dict(first.meta))


def reaches(curve: StepRateCurve, n_max: int) -> bool:
    """Whether a profile was measured as far as verifying ``n_max`` drafts."""
    return curve.batch_sizes[-1] >= n_max + 1


def get_profile(
    model: nn.Module,
    drafter: Drafter,
    profile: str = "auto",
    progress: Callable[[int, int], None] | None = None,
    n_max: int | None = None,
    **measure_kwargs,
) -> StepRateCurve:
    """``"auto"``: the cached profile, measured and cached when missing, when
    it stops short of verifying ``n_max`` drafts (default: the drafter's
    block) or when it contradicts itself and was not measured again yet;
    ``"refresh"``: always re-measure (and cache). A measurement that
    contradicts itself is taken again at once (see the module's notes)."""
    if profile not in ("auto", "refresh"):
        raise DSparkError(f"profile must be 'auto' or 'refresh', got {profile!r}.")
    n_max = drafter.block_size if n_max is None else n_max
    key = profile_key(model, drafter)
    path = profile_path(key)
    logger = logging.getLogger("mlx_dspark")
    cached = load_profile(model, drafter, n_max) if profile == "auto" else None
    if cached is not None and trusted(cached):
        return cached
    if cached is not None:
        logger.info(
            "The cached cost profile %s contradicts itself (%s): measuring it again.",
            path,
            contradiction(cached),
        )
    else:
        logger.info("Measuring this pair's cost profile on this machine into %s.", path)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    curve = measure_profile(target, drafter, n_max, progress=progress, **measure_kwargs)
    reason = contradiction(curve)
    if reason is not None:
        logger.debug(
            "The cost profile contradicts itself (%s): measuring again.", reason
        )
        again = measure_profile(target, drafter, n_max, **measure_kwargs)
        curve = fastest_of(curve, again)
        curve.meta["remeasured"] = reason
        still = contradiction(curve)
        if still is not None:
            curve.meta["contradiction"] = still
    curve.meta["key"] = key
    try:
        write_text_atomic(path, curve.to_json())
    except OSError:
        logger.warning(
            "Could not write the cost profile to %s: each new process measures it "
            "again (MLX_DSPARK_CACHE names a writable cache directory).",
            path,
        )
    return curve


def _blend(stored: float, merged: int, measured: float, rounds: int) -> float:
    """A stored cost (``merged``: rounds runs merged into it before) and a
    run's (measured in ``rounds`` rounds) blended by the module's rule."""
    weight = min(PROFILE_WEIGHT + merged, MOST_WEIGHT)
    share = min(rounds, RUN_WEIGHT)
    measured = min(max(measured, stored / RUN_FACTOR), stored * RUN_FACTOR)
    logs = weight * math.log(stored) + share * math.log(measured)
    return math.exp(logs / (weight + share))


def merge_measured(curve: StepRateCurve, measured: MeasuredCosts) -> StepRateCurve:
    """``curve`` with a run's measurements blended in (the module's rule);
    ``meta["merged"]`` counts the rounds merged into each cost so far (by
    query length, ``"draft"`` and ``"plain"``) and ``meta["runs"]`` the runs."""
    meta = json.loads(json.dumps(curve.meta))  # a deep copy
    merged = {str(k): int(v) for k, v in meta.get("merged", {}).items()}
    rates = zip(curve.batch_sizes, curve.steps_per_second, strict=True)
    stored = {b: 1.0 / r for b, r in rates}
    seconds = dict(stored)
    bound = math.log(RUN_FACTOR)

    def counts(value: float, rounds: int) -> bool:
        return rounds >= LEAST_ROUNDS and math.isfinite(value) and value > 0

    def log_ratio(value: float, old: float) -> float:
        return min(max(math.log(value / old), -bound), bound)

    runs = {
        q: (value, rounds)
        for q, (value, rounds) in measured.verify.items()
        if q in stored and counts(value, rounds)
    }
    if runs:
        # The lengths not measured move as the run priced them: by the
        # measured ratio interpolated (in log space) between the nearest
        # measured lengths, weighing the fewer rounds of those two.
        known = sorted(runs)
        logs = [log_ratio(runs[q][0], stored[q]) for q in known]
        for b, old in stored.items():
            if b in runs:
                rounds = runs[b][1]
            else:
                below = [q for q in known if q < b][-1:]
                above = [q for q in known if q > b][:1]
                rounds = min(runs[q][1] for q in below + above)
            value = old * math.exp(float(np.interp(b, known, logs)))
            seconds[b] = _blend(old, merged.get(str(b), 0), value, rounds)
        for q, (_, rounds) in runs.items():
            merged[str(q)] = merged.get(str(q), 0) + rounds
    draft = curve.draft_seconds
    if measured.draft is not None and draft > 0 and counts(*measured.draft):
        draft = _blend(draft, merged.get("draft", 0), *measured.draft)
        merged["draft"] = merged.get("draft", 0) + measured.draft[1]
    if measured.plain is not None and counts(*measured.plain):
        plain = float(meta.get("plain_seconds") or stored[min(stored)])
        meta["plain_seconds"] = _blend(plain, merged.get("plain", 0), *measured.plain)
        merged["plain"] = merged.get("plain", 0) + measured.plain[1]
    if merged != meta.get("merged", {}):
        meta["merged"] = merged
        meta["runs"] = int(meta.get("runs", 0)) + 1
    return StepRateCurve.from_measurements(seconds, draft, meta)


def _writable(path: Path) -> bool:
    """Whether the file may be replaced: it has a write permission bit (also
    for root, who may write anything) and this process may write it."""
    mode = path.stat().st_mode
    return bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(
        path, os.W_OK
    )


def save_measured(key: dict, measured: MeasuredCosts) -> bool:
    """Merge a run's measurements into the cached profile ``key`` names (see
    the module's notes for the rule and what is never written); whether it
    was written. Never raises: a profile that cannot be written stays as it
    is, and the run that measured it is unaffected."""
    logger = logging.getLogger("mlx_dspark")
    path = profile_path(key)
    try:
        if not measured or not path.is_file() or not _writable(path):
            return False
        try:
            stored = StepRateCurve.load(path)
        except DSparkError:
            return False  # get_profile measures it again
        if stored.meta.get("key") != key or not trusted(stored):
            return False
        merged = merge_measured(stored, measured)
        if merged.meta.get("runs") == stored.meta.get("runs"):
            return False  # nothing measured often enough
        reason = contradiction(merged)
        if reason is not None and "remeasured" not in stored.meta:
            logger.debug(
                "Not writing the run's costs into %s: they would contradict "
                "each other (%s).",
                path,
                reason,
            )
            return False
        if reason is None:
            merged.meta.pop("contradiction", None)
        else:
            merged.meta["contradiction"] = reason
        write_text_atomic(path, merged.to_json())
    except Exception as error:  # noqa: BLE001 - never stops a generation
        logger.debug("Could not write the run's costs into %s: %s", path, error)
        return False
    logger.debug("Wrote the run's measured costs into %s.", path)
    return True
