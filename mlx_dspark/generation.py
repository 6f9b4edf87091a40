"""``generate`` / ``stream_generate`` with DSpark speculation."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .decoding.loop import GenerationStats, speculative_generate_step
from .errors import DSparkError
from .policy.policies import ResolvedPolicy, resolve_policy, resolve_suffix_policy
from .policy.settings import SpeculationSettings, build_settings
from .policy.telemetry import Telemetry
from .proposers.base import Proposer, tree_source
from .proposers.copying import Drafter, own_proposer, pair_proposer
from .proposers.suffix import SUFFIX_MAX_DRAFT, SuffixProposer, suffix_pair_proposer
from .proposers.suffix_files import ProcessStore, process_store, resolve_store_name
from .proposers.suffix_store import SuffixStore
from .sampling.coupled import own_keys, resolve_sampling
from .sampling.processing import SamplingParams
from .targets.adapter import TargetAdapter

logger = logging.getLogger("mlx_dspark")


@dataclass
class DSparkResponse(GenerationResponse):
    """mlx-lm's response plus the speculation statistics so far."""

    stats: GenerationStats | None = None
    telemetry: Telemetry | None = None
    settings: SpeculationSettings | None = None


def _encode(
    tokenizer: TokenizerWrapper, prompt: str | list[int] | mx.array
) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    if len(prompt) == 0:
        raise DSparkError("The prompt is empty.")
    return mx.array(prompt)


def _target_only_tokens(model, prompt, params: SamplingParams, max_tokens: int, seed):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(
        params.temperature,
        params.top_p,
        params.min_p,
        params.min_tokens_to_keep,
        top_k=params.top_k,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=list(params.xtc_special_tokens),
    )
    for token, _ in generate_step(
        prompt, model, max_tokens=max_tokens, sampler=sampler
    ):
        yield int(token), False


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    drafter: Drafter | None,
    prompt: str | list[int] | mx.array,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    num_draft: int | None = None,
    confidence_threshold: float | None = None,
    scheduler: str | None = None,
    profile: str = "auto",
    tree_budget: int = 0,
    min_tokens_to_keep: int = 1,
    prefill_step_size: int = 512,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Sequence[int] = (),
    profile_progress: Callable[[int, int], None] | None = None,
    settings: SpeculationSettings | None = None,
    sampling: str | None = None,
    suffix: bool = False,
    suffix_store: SuffixStore | str | os.PathLike | None = "process",
) -> Generator[DSparkResponse, None, None]:
    """Like ``mlx_lm.stream_generate``; ``drafter=None`` decodes with the target alone.

    ``scheduler``: ``"off"`` (fixed ``num_draft``), ``"threshold"`` (cut at
    ``confidence_threshold``), ``"auto"`` (calibrated prefix scheduler with the
    memory guard), ``"adaptive"`` (each round the draft length, 0 = plain
    decoding included, with the best predicted tokens/s) or None: adaptive
    when no other DSpark argument is given, an explicit ``num_draft`` means
    always that many. ``confidence_threshold=None`` means
    ``DSPARK_CONFIDENCE_THRESHOLD`` or off; a given threshold wins over it.
    ``profile="refresh"`` re-measures the cost profile (the default policy
    merges what a generation measured into the cached profile when it ends,
    :func:`~mlx_dspark.policy.profile.save_measured`);
    ``profile_progress(done, total)`` follows a measurement. ``settings``: a
    setup :func:`~mlx_dspark.policy.settings.build_settings` already decided from
    these arguments (then leave them out). Responses carry ``stats``,
    ``telemetry`` and ``settings`` (with its ``notes`` for the user).

    ``suffix=True`` with ``drafter=None`` drafts with no drafter, from what
    the target has written (the prompt and the output so far,
    :mod:`~mlx_dspark.proposers.suffix`); each round offered a suffix draft
    verifies as much of it as the policy's measured acceptance and costs
    say pays (``num_draft``, at most 16, bounds it); rounds without one are
    plain target steps. With a drafter, each round takes the suffix draft
    (verified as it is, the drafter not run), the drafter's block or a plain
    step, whichever the measured costs and this generation's acceptance of
    each predict fastest; the drafter's ``phrases.npy`` is the suffix
    drafts' global store (chains only).

    ``suffix_store`` (with ``suffix=True`` and no drafter): the global store
    the drafts also come from, into which the response is written live and
    closed when the generation ends (SuffixDecoding's global tree;
    :mod:`~mlx_dspark.proposers.suffix_files`). ``"process"`` (the default):
    an in-memory store kept on the ``tokenizer`` object, so later
    generations with it draft from earlier ones' output; ``"auto"``: the
    same, read at first use from the user cache
    (``cache_dir()/suffix/<tokenizer fingerprint>.npz``) and written back
    atomically when each generation ends; a file path: the same with that
    file; a :class:`~mlx_dspark.proposers.suffix_store.SuffixStore`: that
    store (the caller saves it); ``"none"`` or None: the request's own
    index only. A file that cannot be used is moved aside to
    ``<name>.bad`` and a fresh store starts; the first response's
    ``settings.notes`` say so.

    ``tree_budget`` > 0 drafts a tree of that many nodes per round instead of
    a chain (``num_draft`` then bounds its depth); 0 drafts a chain.
    ``min_tokens_to_keep``, ``prefill_step_size`` and the ``xtc_*`` arguments
    mean what they mean in mlx-lm (min-p filter, prompt tokens per prefill
    forward, XTC sampling, see :class:`~mlx_dspark.sampling.processing.SamplingParams`).

    ``seed``: sampled output is then token for token what
    ``mlx_lm.stream_generate`` gives after ``mx.random.seed(seed)`` with the
    same sampling arguments, whatever the policy, and the global key state
    is left alone. ``sampling``: ``"coupled"`` or ``"residual"`` (see
    :mod:`~mlx_dspark.sampling.coupled`); None: coupled with a seed, else
    :data:`~mlx_dspark.sampling.coupled.UNSEEDED_SAMPLING`. Coupled without a seed
    draws from the global key state as mlx-lm does (so ``mx.random.seed(S)``
    before the call reproduces mlx-lm's output too). A seed with
    ``"residual"`` repeats only with a fixed ``num_draft``.
    """
    holder = tokenizer  # the object the process store is kept on
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if max_tokens < 1:
        raise DSparkError(f"max_tokens must be at least 1, got {max_tokens}.")
    params = SamplingParams(
        temperature,
        top_p,
        top_k,
        min_p,
        min_tokens_to_keep,
        xtc_probability,
        xtc_threshold,
        tuple(int(t) for t in xtc_special_tokens),
    )
    prompt = _encode(tokenizer, prompt)
    sampling = resolve_sampling(sampling, seed)

    stats = telemetry = None
    if drafter is None and not suffix:
        tokens = _target_only_tokens(model, prompt, params, max_tokens, seed)
    else:
        given = {
            "num_draft": num_draft,
            "confidence_threshold": confidence_threshold,
            "scheduler": scheduler,
            "profile": None if profile == "auto" else profile,
            "tree_budget": tree_budget or None,
        }
        given = {name: value for name, value in given.items() if value is not None}
        block_size = SUFFIX_MAX_DRAFT if drafter is None else drafter.block_size
        if settings is None:
            settings = build_settings(block_size, **given)
        elif given:
            raise DSparkError(
                f"Pass settings or {next(iter(given))}, not both: settings "
                "already hold every DSpark argument."
            )
        if drafter is None:
            kept = _suffix_store(holder, tokenizer, suffix_store)
            store = kept.store if isinstance(kept, ProcessStore) else kept
            if isinstance(kept, ProcessStore) and kept.note:
                settings = replace(settings, notes=(*settings.notes, kept.note))
                kept.note = None  # said once
            resolved, target, proposer = _suffix_setup(model, settings, store)
        else:
            resolved, target, proposer = _drafter_setup(
                model, drafter, settings, profile_progress, suffix
            )
        telemetry = resolved.policy.telemetry
        telemetry.policy, telemetry.note = resolved.mode, resolved.note
        telemetry.calibration = resolved.calibration_path
        telemetry.profile = resolved.profile_path
        if resolved.note:
            logger.info(resolved.note)
        stats = GenerationStats()
        tokens = speculative_generate_step(
            prompt,
            target,
            proposer,
            params=params,
            num_draft=settings.num_draft,
            max_tokens=max_tokens,
            policy=resolved.policy,
            mode=settings.make_mode(),
            seed=seed,
            stats=stats,
            prefill_step_size=prefill_step_size,
            sampling=sampling,
            stop_ids=getattr(tokenizer, "eos_token_ids", ()),
        )

    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps = 0.0

    def response(token, from_draft, n, finish_reason=None):
        return DSparkResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=None,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
            stats=stats,
            telemetry=telemetry,
            settings=settings,
        )

    # What the policy measured goes into the cached cost profile when the
    # generation ends, also when the caller stops reading early.
    save_costs = (
        None if drafter is None else getattr(resolved.policy, "save_costs", None)
    )
    # The response goes into the suffix store as it is written; its document
    # is closed (and a store with a file saved) when the generation ends, also
    # when the caller stops reading early.
    written = prompt.tolist()
    finish_suffix = None
    if drafter is None and suffix:

        def finish_suffix():
            proposer.close_all(written)
            failed = kept.save() if isinstance(kept, ProcessStore) else None
            if failed:
                logger.warning(failed)

    try:
        for n, (token, from_draft) in enumerate(tokens):
            if n == 0:
                prompt_tps = prompt.size / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            written.append(token)
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield response(token, from_draft, n + 1)
        detokenizer.finalize()
        reason = "stop" if token in tokenizer.eos_token_ids else "length"
        if save_costs is not None:
            save_costs()
            save_costs = None
        yield response(token, from_draft, n + 1, reason)
    finally:
        if save_costs is not None:
            save_costs()
        if finish_suffix is not None:
            finish_suffix()


def _drafter_setup(
    model: nn.Module,
    drafter: Drafter,
    settings: SpeculationSettings,
    progress: Callable[[int, int], None] | None,
    suffix: bool = False,
) -> tuple[ResolvedPolicy, TargetAdapter, Proposer]:
    """The policy, target adapter and proposer of a drafter's pair (with
    ``suffix``, suffix drafts and the drafter's block chosen round by
    round)."""
    if suffix and settings.tree_budget:
        raise DSparkError(
            "Suffix drafts with a drafter run chains only: drop tree_budget "
            "(--dspark-tree), or the drafter for suffix trees."
        )
    # Profiling and calibration draw no key mlx-lm's sampler would use.
    with own_keys():
        resolved = resolve_policy(
            model, drafter, settings, progress=progress, suffix=suffix
        )
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    if settings.tree_budget:
        target.check_tree()
        tree_source(own_proposer(drafter))  # or: it proposes chains only
    if suffix:
        longest = settings.copy_draft or settings.num_draft
        proposer = suffix_pair_proposer(drafter, min(longest, SUFFIX_MAX_DRAFT))
    else:
        proposer = pair_proposer(drafter, settings.copy_draft, settings.copy_as_is)
    return resolved, target, proposer


def _suffix_store(
    holder: Any, tokenizer: TokenizerWrapper, value: Any
) -> ProcessStore | SuffixStore | None:
    """The global store ``suffix_store`` names (see :func:`stream_generate`)."""
    name = resolve_store_name(value)
    if name is None or isinstance(name, SuffixStore):
        return name
    return process_store(holder, tokenizer, name)


def _suffix_setup(
    model: nn.Module, settings: SpeculationSettings, store: SuffixStore | None = None
) -> tuple[ResolvedPolicy, TargetAdapter, Proposer]:
    """The policy, target adapter (no feature taps) and proposer of suffix
    drafts with no drafter (``store``: the global part, if any)."""
    resolved = resolve_suffix_policy(settings)
    target = TargetAdapter(model)
    tree = settings.tree_budget > 0
    if tree:
        target.check_tree()
    proposer = SuffixProposer(
        target.vocab_size,
        store=store,
        tree=tree,
        tree_budget=settings.tree_budget or SUFFIX_MAX_DRAFT,
    )
    return resolved, target, proposer


def suffix_stats(stats: GenerationStats | None) -> str | None:
    """One line on the rounds that verified a suffix draft (rounds offered a
    copy that drafted): how many, and how much of what they verified was
    kept; then those whose draft came from the global store (earlier
    generations' text). None when the generation has no round statistics."""
    if stats is None or not stats.rounds:
        return None
    rounds = [r for r in stats.rounds if r.copy_offered and r.drafted > 0]
    verified = sum(r.verified for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    rate = accepted / verified if verified else 0.0
    line = (
        f"Suffix drafts: {len(rounds)} of {len(stats.rounds)} rounds, "
        f"{accepted} of {verified} drafted tokens accepted ({rate:.0%})"
    )
    shared = [r for r in rounds if r.source == "global"]
    if shared:
        kept = sum(r.accepted for r in shared)
        line += (
            f"; {len(shared)} rounds drafted from earlier text "
            f"(the suffix store), {kept} tokens accepted"
        )
    return line


_POLICY_NAMES = {
    "adaptive": "adaptive (the draft length with the best measured tokens/s)",
    "off": "fixed draft length",
    "threshold": "confidence threshold",
    "auto": "calibrated scheduler",
}


_KIND_NAMES = {
    "plain": "Plain rounds",
    "own": "Drafter's own block",
    "copy": "Context copy",
    "phrases": "Phrase-store copy",
}


def _kind_lines(stats: GenerationStats) -> list[str]:
    """A line per kind of round that ran: how many rounds, drafts verified and
    tokens kept per round, the longest verified."""
    total = len(stats.rounds)
    lines = []
    for kind, summary in stats.by_kind().items():
        line = f"{_KIND_NAMES[kind]}: {summary.rounds} of {total} rounds"
        if kind == "plain":
            line += " (one target step, 1 token each)"
        else:
            line += (
                f", {summary.verified_per_round:.2f} drafts verified and "
                f"{summary.kept_per_round:.2f} tokens kept per round, "
                f"longest verified {summary.longest}"
            )
        lines.append(line)
    return lines


# The confidence head's check holds when expected and accepted drafts per
# round differ by at most this share of the accepted (or a quarter draft).
CHECK_TOLERANCE = 0.2


def _confidence_check(tele: Telemetry) -> str | None:
    """Expected vs accepted drafts per round over the rounds the confidence
    head predicted, and whether to (re)calibrate."""
    check = tele.predicted_check
    if check is None:
        return None
    expected, accepted = check
    line = (
        f"Confidence head: expected {expected:.2f} vs accepted {accepted:.2f} "
        f"drafts per round over the {tele.predicted_rounds} rounds it predicted"
    )
    if not tele.calibration:
        return line + "; uncalibrated (raw confidences): run mlx_dspark.calibrate"
    if abs(expected - accepted) <= max(0.25, CHECK_TOLERANCE * accepted):
        return line + "; the calibration holds"
    way = "over" if expected > accepted else "under"
    return line + (
        f"; the calibration is {way}-confident on this text: "
        "run mlx_dspark.calibrate on prompts like it"
    )


def format_stats(response: DSparkResponse) -> list[str]:
    lines = [
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec",
    ]
    stats = response.stats
    if stats is not None and stats.rounds:
        by_position = " ".join(f"{rate:.2f}" for rate in stats.acceptance_by_position)
        lines += [
            f"Mean accepted length: {stats.mean_accepted_length:.2f} tokens per round ({len(stats.rounds)} rounds)",
            f"Acceptance by position: {by_position or '-'}",
            f"Draft / verify time: {stats.draft_time:.3f} s / {stats.verify_time:.3f} s",
        ]
    tele = response.telemetry
    if tele is not None and tele.n_rounds:
        lines.append(f"Policy: {_POLICY_NAMES.get(tele.policy, tele.policy)}")
    if stats is not None and stats.rounds:
        lines += _kind_lines(stats)
    if tele is not None and tele.n_rounds:
        check = _confidence_check(tele)
        if check:
            lines.append(check)
        if tele.note:
            lines.append(tele.note)
        if tele.calibration:
            lines.append(f"Calibration: {tele.calibration}")
        if tele.profile:
            lines.append(f"Cost profile: {tele.profile}")
    lines.append(f"Peak memory: {response.peak_memory:.3f} GB")
    return lines


def generate(
    model: nn.Module,
    tokenizer: Any,
    drafter: Drafter | None,
    prompt: str | list[int] | mx.array,
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response; see :func:`stream_generate` for arguments."""
    if verbose:
        print("=" * 10)
    text = ""
    for response in stream_generate(model, tokenizer, drafter, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        print("\n".join(format_stats(response)))
        if kwargs.get("suffix"):
            print(suffix_stats(response.stats))
    return text
