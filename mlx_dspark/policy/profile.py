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
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
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
from .scheduler import StepRateCurve

PROFILE_VERSION = 2
DEFAULT_CONTEXTS = (64, 256)
# A forward over more tokens does the same work and more. BLAS picks other
# kernels at some sizes, so a longer one may come out a little faster, not
# this many times faster.
LONGER_FASTER = 1.5


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
        first = Round(tokens, features[:, :-1], 1, SamplingParams(), None)
        proposer.propose(primed, first)
        mx.eval(primed.keys, primed.values)
        round = Round(
            [*tokens, tokens[-1]],
            features[:, -1:],
            drafter.block_size,
            SamplingParams(),
            None,
        )

        def draft(primed=primed, round=round):
            # The caches' lists are copied: a round replaces their entries.
            state = replace(primed, keys=list(primed.keys), values=list(primed.values))
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
