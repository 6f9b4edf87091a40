"""What the benchmark runs: the pair, the decoding modes and their registry."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..decoding.loop import GenerationStats, RoundStats
from ..errors import DSparkError
from ..generation import stream_generate
from ..policy.settings import SpeculationSettings, build_settings
from ..proposers.copying import Drafter, own_proposer
from ..targets.adapter import TargetAdapter


@dataclass
class Pair:
    """What the modes run on."""

    model: nn.Module
    tokenizer: Any
    drafter: Drafter | None
    label: str
    synthetic: bool = False
    mlx_lm_draft: nn.Module | None = None
    mlx_lm_draft_label: str | None = None
    _adapter: TargetAdapter | None = None

    @property
    def adapter(self) -> TargetAdapter:
        if self._adapter is None:
            self._adapter = TargetAdapter(
                self.model, self.drafter.config.target_layer_ids
            )
        return self._adapter

    @property
    def vocab_size(self) -> int:
        return TargetAdapter(self.model).vocab_size


@dataclass
class Settings:
    fixed_n: list[int]
    thresholds: list[float]
    mlx_lm_num_draft: int
    tree_budgets: list[int] = field(default_factory=lambda: [8, 16])


@dataclass
class Run:
    """One generation: the tokens (stop token excluded) and its timings."""

    tokens: list[int]
    decode_time: float
    total_time: float
    stats: GenerationStats | None = None


Runner = Callable[[Pair, list[int], int], Run]


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "target", "mlx-lm" or "dspark"
    run: Runner
    num_draft: int | None = None
    threshold: float | None = None
    settings: SpeculationSettings | None = None  # a DSpark mode's setup


def _collect(
    responses: Iterable[Any],
) -> tuple[list[int], list[bool], float, float, Any]:
    """Drain a ``stream_generate`` (mlx-lm's or ours, which stop at
    end-of-sequence and ``max_tokens`` alike): the tokens (the stop token not
    kept), their ``from_draft`` flags, the decoding time after the first token,
    the total time and the last response."""
    tokens, drafted = [], []
    tic = time.perf_counter()
    first = last = None
    for response in responses:
        if first is None:
            first = time.perf_counter()
        last = response
        if response.finish_reason != "stop":
            tokens.append(int(response.token))
            drafted.append(bool(response.from_draft))
    end = time.perf_counter()
    return tokens, drafted, end - (first or end), end - tic, last


def _mlx_lm_responses(pair: Pair, prompt: list[int], max_tokens: int, **kwargs):
    from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

    return mlx_lm_stream_generate(
        pair.model, pair.tokenizer, mx.array(prompt), max_tokens=max_tokens, **kwargs
    )


def run_target(pair: Pair, prompt: list[int], max_tokens: int) -> Run:
    tokens, _, decode, total, _ = _collect(_mlx_lm_responses(pair, prompt, max_tokens))
    return Run(tokens, decode, total)


def sampled_target_runner(temperature: float, seed: int) -> Runner:
    """mlx-lm's own decoding at ``temperature`` after ``mx.random.seed(seed)``:
    the tokens a seeded DSpark generation must reproduce."""
    from mlx_lm.sample_utils import make_sampler

    def run(pair: Pair, prompt: list[int], max_tokens: int) -> Run:
        mx.random.seed(seed)
        responses = _mlx_lm_responses(
            pair, prompt, max_tokens, sampler=make_sampler(temperature)
        )
        tokens, _, decode, total, _ = _collect(responses)
        return Run(tokens, decode, total)

    return run


def _rounds_from_flags(drafted: list[bool], num_draft: int) -> GenerationStats:
    """Rounds of mlx-lm's speculative decoding, from its ``from_draft`` flags:
    each target-sampled token closes a round (it verified ``num_draft``)."""
    stats, accepted = GenerationStats(), 0
    for flag in drafted[1:]:
        if flag:
            accepted += 1
        else:
            stats.rounds.append(RoundStats(num_draft, num_draft, accepted))
            accepted = 0
    return stats


def mlx_lm_runner(num_draft: int) -> Runner:
    def run(pair: Pair, prompt: list[int], max_tokens: int) -> Run:
        responses = _mlx_lm_responses(
            pair,
            prompt,
            max_tokens,
            draft_model=pair.mlx_lm_draft,
            num_draft_tokens=num_draft,
        )
        tokens, drafted, decode, total, _ = _collect(responses)
        return Run(tokens, decode, total, _rounds_from_flags(drafted, num_draft))

    return run


def dspark_runner(
    settings: SpeculationSettings,
    drafter: Any = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> Runner:
    """A runner for DSpark's public ``stream_generate`` with one speculation
    setup, greedy unless a ``temperature`` is given (then seeded); its
    responses carry the rounds' statistics and timings. ``drafter``: any
    drafter ``stream_generate`` takes (default: the pair's)."""

    def run(pair: Pair, prompt: list[int], max_tokens: int) -> Run:
        responses = stream_generate(
            pair.model,
            pair.tokenizer,
            pair.drafter if drafter is None else drafter,
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            settings=settings,
        )
        tokens, _, decode, total, last = _collect(responses)
        return Run(tokens, decode, total, last.stats)

    return run


def dspark_variant(name: str, pair: Pair, **arguments) -> Variant:
    """A DSpark mode: the setup ``build_settings`` makes of ``arguments``
    for this pair's drafter, as a user passing them would get."""
    settings = build_settings(pair.drafter.block_size, **arguments)
    threshold = (
        settings.confidence_threshold if settings.policy == "threshold" else None
    )
    run = dspark_runner(settings)
    return Variant(name, "dspark", run, settings.num_draft, threshold, settings)


def _target_modes(pair: Pair, settings: Settings) -> list[Variant]:
    return [Variant("target", "target", run_target)]


def _mlx_lm_modes(pair: Pair, settings: Settings) -> list[Variant]:
    if pair.mlx_lm_draft is None:
        return []
    n = settings.mlx_lm_num_draft
    return [Variant(f"mlx-lm-spec-{n}", "mlx-lm", mlx_lm_runner(n), num_draft=n)]


def _fixed_modes(pair: Pair, settings: Settings) -> list[Variant]:
    return [
        dspark_variant(
            f"dspark-fixed-{n}",
            pair,
            num_draft=n,
            confidence_threshold=0.0,
            scheduler="off",
            names={"num_draft": "--fixed-n"},
        )
        for n in settings.fixed_n
    ]


def _threshold_modes(pair: Pair, settings: Settings) -> list[Variant]:
    return [
        dspark_variant(
            f"dspark-threshold-{t:g}",
            pair,
            confidence_threshold=t,
            scheduler="threshold",
            names={"confidence_threshold": "--thresholds"},
        )
        for t in settings.thresholds
    ]


def _scheduler_modes(pair: Pair, settings: Settings) -> list[Variant]:
    return [
        dspark_variant(
            "dspark-scheduler", pair, confidence_threshold=0.0, scheduler="auto"
        )
    ]


def _default_modes(pair: Pair, settings: Settings) -> list[Variant]:
    """What runs when the user passes no DSpark flags (the adaptive policy)."""
    return [dspark_variant("dspark-default", pair)]


def _tree_modes(pair: Pair, settings: Settings) -> list[Variant]:
    # Trees need a target that verifies them and a proposer with tree rows
    # (EAGLE-3 proposes chains only).
    proposer = own_proposer(pair.drafter)
    if not pair.adapter.supports_tree or not hasattr(proposer, "tree_source"):
        return []
    return [
        dspark_variant(
            f"dspark-tree-{budget}",
            pair,
            confidence_threshold=0.0,
            scheduler="off",
            tree_budget=budget,
            names={"tree_budget": "--tree-budgets"},
        )
        for budget in settings.tree_budgets
    ]


# The mode registry: name -> variants for a pair. Adding a mode (a tree mode,
# another policy) is one entry; a builder returns [] when it does not apply.
MODES: dict[str, Callable[[Pair, Settings], list[Variant]]] = {
    "target": _target_modes,
    "mlx-lm": _mlx_lm_modes,
    "fixed": _fixed_modes,
    "threshold": _threshold_modes,
    "scheduler": _scheduler_modes,
    "default": _default_modes,
    "tree": _tree_modes,
}
DRAFTER_MODES = ("fixed", "threshold", "scheduler", "default", "tree")


def select_variants(pair: Pair, settings: Settings, names: list[str]) -> list[Variant]:
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise DSparkError(
            f"Unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}."
        )
    if "target" not in names:
        names = ["target", *names]  # every speedup is relative to it
    variants = []
    for name in names:
        if name in DRAFTER_MODES and pair.drafter is None:
            continue
        variants.extend(MODES[name](pair, settings))
    return variants


def make_useless(drafter: Drafter) -> None:
    """Random weights, and no calibration: the one beside the drafter's
    directory was measured on its real weights."""
    randomize_weights(drafter)
    drafter.source_path = None


def randomize_weights(model: nn.Module, seed: int = 0) -> None:
    """Replace every floating-point weight by Gaussian noise of the same shape
    and spread: a drafter of the right shape that proposes nothing useful."""
    key = mx.random.key(seed)
    weights = []
    for name, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            key, sub = mx.random.split(key)
            std = mx.maximum(mx.std(value.astype(mx.float32)), 1e-3)
            noise = mx.random.normal(value.shape, key=sub) * std
            value = noise.astype(value.dtype)
        weights.append((name, value))
    model.load_weights(weights)
    mx.eval(model.parameters())
