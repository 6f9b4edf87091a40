"""Side-by-side speed and acceptance report, roofline, synthetic pairs, parity.

Usage::

    mlx_dspark.benchmark [--model T --draft-model D] [--prompts chat|code|math|FILE]
        [--max-tokens N] [--trials N] [--modes target,mlx-lm,fixed,threshold,scheduler,tree]
        [--json PATH] [--plot DIR] [--mlx-lm-draft-model M]
    mlx_dspark.benchmark --synthetic 0.6b|1.7b|4b [--bits 4|8|16|32] [--accept chat|math]
    mlx_dspark.benchmark [pair options] --parity-record trace.json
    mlx_dspark.benchmark [pair options] --parity-check trace.json
    mlx_dspark.benchmark [pair options] [--fixed-n 1,7] --profile

In one process and on the same prompts it runs target-only decoding (mlx-lm's
own ``stream_generate``), mlx-lm's speculative decoding (with
``--mlx-lm-draft-model``) and DSpark in every mode of :data:`MODES`, trials
interleaved so that machine noise hits every mode alike. Per mode: tok/s
(median, min and max over trials), speedup over target-only, mean accepted
length, acceptance by position, draft and verify time, peak memory, and
whether the greedy output equals target-only's. It also measures the memory
bandwidth and reports the plain-decoding ceiling (bandwidth / bytes read per
target step) and which BLAS the CPU backend used. Without ``--model`` it runs
the built-in default pair (:func:`mlx_dspark.default.default_pair`).

``--synthetic`` runs a Qwen3-shaped target of real size with structured
weights (see :mod:`mlx_dspark.synthetic`); all its outputs say "synthetic".

Backend parity (greedy): record a golden trace on one backend, replay it on
another; the check names the first divergence and exits non-zero. On an
NVIDIA machine::

    pip install -e ".[cuda]"     # mlx[cuda]
    mlx_dspark.benchmark --parity-record cpu-trace.json           # here (CPU)
    mlx_dspark.benchmark --parity-check cpu-trace.json            # there (CUDA)

The trace stores the prompts, the committed tokens, every round's drafts and
accepted count, and per draft position the sum, absolute sum and maximum of
the draft logits (compared with ``--parity-rtol``, default 1e-3).

``--profile`` splits a greedy round into its stages and compares the
adapter's target forward with mlx-lm's (see :mod:`mlx_dspark.roundprofile`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .default import default_pair
from .drafter import DSparkDrafter, Proposal
from .errors import DSparkError, run_cli
from .loop import (
    ChainMode,
    GenerationStats,
    RoundStats,
    ThresholdPolicy,
    speculative_generate_step,
)
from .policies import resolve_policy
from .sampling import SamplingParams
from .target import TargetAdapter
from .tree import TreeMode

SCHEMA_VERSION = "mlx-dspark-benchmark/1"
PARITY_FORMAT = "mlx-dspark-parity/1"


# --------------------------------------------------------------------------
# Prompts

PROMPT_SETS: dict[str, list[str]] = {
    "chat": [
        "What is a good way to spend a rainy Sunday afternoon at home?",
        "Explain to a child why the sky is blue.",
        "Write a short, friendly note thanking a neighbour for watering my plants.",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Implement binary search over a sorted list in Python and explain it.",
        "Write a shell command that counts the lines of every .py file in a folder.",
    ],
    "math": [
        "A train travels 120 km in 1.5 hours. What is its average speed? Show the steps.",
        "Solve for x: 3x + 7 = 25. Explain each step.",
        "What is the sum of the integers from 1 to 100? Show the reasoning.",
    ],
}


def load_prompts(spec: str) -> tuple[str, list[str]]:
    """``(name, prompts)`` for a built-in set or a file.

    A ``.json`` file holds a list of strings; any other file one prompt per
    non-empty line.
    """
    if spec in PROMPT_SETS:
        return spec, list(PROMPT_SETS[spec])
    path = Path(spec).expanduser()
    if not path.exists():
        if os.sep in spec or "." in spec:
            raise DSparkError(f"The prompt file {spec} does not exist.")
        raise DSparkError(
            f"Unknown prompt set {spec!r}; use chat, code, math or a file path."
        )
    if not path.is_file():
        raise DSparkError(f"The prompt path {spec} is not a file.")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        raise DSparkError(f"The prompt file {spec} is not readable text.") from None
    if path.suffix == ".json":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError:
            raise DSparkError(f"The prompt file {spec} is not valid JSON.") from None
        if not isinstance(prompts, list) or not all(
            isinstance(p, str) for p in prompts
        ):
            raise DSparkError(
                f"The prompt file {spec} must hold a JSON list of strings."
            )
    else:
        prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise DSparkError(f"The prompt file {spec} holds no prompts.")
    return path.name, prompts


def encode_prompt(tokenizer, text: str, vocab_size: int, chat: bool) -> list[int]:
    """Token ids of a prompt.

    Built-in structured pairs have a toy word-level tokenizer that maps all
    text to its unknown token; there, each word is hashed to a token id so
    prompts stay distinct and deterministic.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    if chat and getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    else:
        ids = tokenizer.encode(text)
    ids = list(ids)
    if not ids or (unk is not None and ids.count(unk) * 2 > len(ids)):
        chain = max(vocab_size - 2, 1)
        ids = [zlib.crc32(word.encode()) % chain for word in text.split()]
    if not ids:
        raise DSparkError("A prompt is empty.")
    return ids


# --------------------------------------------------------------------------
# Modes


@dataclass
class Pair:
    """What the modes run on."""

    model: nn.Module
    tokenizer: Any
    drafter: DSparkDrafter | None
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


def _consume(
    steps: Iterable[tuple[int, bool]], tokenizer, max_tokens: int
) -> tuple[list[int], list[bool], float, float]:
    """Drive a token stream as ``stream_generate`` does: detokenize, stop at
    end-of-sequence (not kept) or ``max_tokens``; time decoding after the
    first token."""
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tokens, drafted = [], []
    tic = time.perf_counter()
    first = None
    for token, from_draft in steps:
        if first is None:
            first = time.perf_counter()
        if token in eos:
            break
        detokenizer.add_token(token)
        tokens.append(int(token))
        drafted.append(bool(from_draft))
        if len(tokens) == max_tokens:
            break
    detokenizer.finalize()
    end = time.perf_counter()
    return tokens, drafted, end - (first or end), end - tic


def _mlx_lm_steps(pair: Pair, prompt: list[int], max_tokens: int, **kwargs):
    from mlx_lm.generate import stream_generate

    for response in stream_generate(
        pair.model, pair.tokenizer, mx.array(prompt), max_tokens=max_tokens, **kwargs
    ):
        yield response.token, response.from_draft


def run_target(pair: Pair, prompt: list[int], max_tokens: int) -> Run:
    tokens, _, decode, total = _consume(
        _mlx_lm_steps(pair, prompt, max_tokens), pair.tokenizer, max_tokens
    )
    return Run(tokens, decode, total)


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
        steps = _mlx_lm_steps(
            pair,
            prompt,
            max_tokens,
            draft_model=pair.mlx_lm_draft,
            num_draft_tokens=num_draft,
        )
        tokens, drafted, decode, total = _consume(steps, pair.tokenizer, max_tokens)
        return Run(tokens, decode, total, _rounds_from_flags(drafted, num_draft))

    return run


def dspark_runner(
    num_draft: int | None,
    policy: Callable[[Pair], Any],
    mode: Callable[[], Any] = ChainMode,
) -> Runner:
    """A runner for the one DSpark loop with a policy and a mode plugged in."""

    def run(pair: Pair, prompt: list[int], max_tokens: int) -> Run:
        stats = GenerationStats()
        steps = speculative_generate_step(
            mx.array(prompt),
            pair.adapter,
            pair.drafter,
            params=SamplingParams(),
            num_draft=num_draft,
            max_tokens=max_tokens,
            policy=policy(pair),
            mode=mode(),
            seed=0,
            stats=stats,
        )
        tokens, _, decode, total = _consume(steps, pair.tokenizer, max_tokens)
        return Run(tokens, decode, total, stats)

    return run


def _target_modes(pair: Pair, settings: Settings) -> list[Variant]:
    return [Variant("target", "target", run_target)]


def _mlx_lm_modes(pair: Pair, settings: Settings) -> list[Variant]:
    if pair.mlx_lm_draft is None:
        return []
    n = settings.mlx_lm_num_draft
    return [Variant(f"mlx-lm-spec-{n}", "mlx-lm", mlx_lm_runner(n), num_draft=n)]


def _fixed_modes(pair: Pair, settings: Settings) -> list[Variant]:
    return [
        Variant(
            f"dspark-fixed-{n}",
            "dspark",
            dspark_runner(n, lambda pair: ThresholdPolicy(0.0)),
            num_draft=n,
        )
        for n in settings.fixed_n
    ]


def _threshold_modes(pair: Pair, settings: Settings) -> list[Variant]:
    block = pair.drafter.block_size
    return [
        Variant(
            f"dspark-threshold-{t:g}",
            "dspark",
            dspark_runner(block, lambda pair, t=t: ThresholdPolicy(t)),
            num_draft=block,
            threshold=t,
        )
        for t in settings.thresholds
    ]


def _scheduler_modes(pair: Pair, settings: Settings) -> list[Variant]:
    def policy(pair: Pair):
        return resolve_policy(pair.model, pair.drafter, "auto", progress=False).policy

    block = pair.drafter.block_size
    return [Variant("dspark-scheduler", "dspark", dspark_runner(block, policy), block)]


def _default_modes(pair: Pair, settings: Settings) -> list[Variant]:
    """What runs when the user passes no DSpark flags (the adaptive policy)."""

    def policy(pair: Pair):
        return resolve_policy(pair.model, pair.drafter, None, progress=False).policy

    block = pair.drafter.block_size
    return [Variant("dspark-default", "dspark", dspark_runner(None, policy), block)]


def _tree_modes(pair: Pair, settings: Settings) -> list[Variant]:
    block = pair.drafter.block_size
    return [
        Variant(
            f"dspark-tree-{budget}",
            "dspark",
            dspark_runner(
                block, lambda pair: ThresholdPolicy(0.0), lambda b=budget: TreeMode(b)
            ),
            num_draft=block,
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


# --------------------------------------------------------------------------
# JSON schema (a small subset of JSON Schema, validated by hand)

_NUMBER = {"type": "number", "minimum": 0}
_OPT_NUMBER = {"type": ["number", "null"], "minimum": 0}

RECORD_SCHEMA: dict = {
    "type": "object",
    "required": [
        "mode",
        "kind",
        "synthetic",
        "tok_per_s",
        "tok_per_s_min",
        "tok_per_s_max",
        "tok_per_s_trials",
        "speedup",
        "ceiling_fraction",
        "mean_accepted_length",
        "acceptance_by_position",
        "draft_time_s",
        "verify_time_s",
        "peak_memory_gb",
        "tokens",
        "rounds",
        "lossless",
    ],
    "properties": {
        "mode": {"type": "string"},
        "kind": {"enum": ["target", "mlx-lm", "dspark"]},
        "synthetic": {"type": "boolean"},
        "num_draft": {"type": ["integer", "null"], "minimum": 0},
        "threshold": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "tok_per_s": {"type": "number", "exclusiveMinimum": 0},
        "tok_per_s_min": _NUMBER,
        "tok_per_s_max": _NUMBER,
        "tok_per_s_trials": {"type": "array", "items": _NUMBER},
        "speedup": {"type": "number", "exclusiveMinimum": 0},
        "ceiling_fraction": _OPT_NUMBER,
        "mean_accepted_length": {"type": "number", "minimum": 1},
        "acceptance_by_position": {
            "type": "array",
            "items": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "draft_time_s": _OPT_NUMBER,
        "verify_time_s": _OPT_NUMBER,
        "peak_memory_gb": _NUMBER,
        "tokens": {"type": "integer", "minimum": 0},
        "rounds": {"type": ["integer", "null"], "minimum": 0},
        "lossless": {"type": ["boolean", "null"]},
    },
}

REPORT_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "synthetic", "pair", "settings", "machine", "records"],
    "properties": {
        "schema": {"enum": [SCHEMA_VERSION]},
        "synthetic": {"type": "boolean"},
        "pair": {"type": "object"},
        "settings": {"type": "object"},
        "machine": {
            "type": "object",
            "required": [
                "backend",
                "blas",
                "blas_gflops",
                "bandwidth_gb_s",
                "target_bytes_per_step",
                "ceiling_tok_per_s",
            ],
            "properties": {
                "backend": {"type": "string"},
                "blas": {"type": "string"},
                "blas_gflops": _OPT_NUMBER,
                "bandwidth_gb_s": _NUMBER,
                "target_bytes_per_step": {"type": "integer", "minimum": 0},
                "ceiling_tok_per_s": _NUMBER,
            },
        },
        "records": {"type": "array", "items": RECORD_SCHEMA},
    },
}

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def validate(instance: Any, schema: dict, path: str = "$") -> list[str]:
    """Errors of ``instance`` against ``schema`` (type, enum, required,
    properties, items, minimum, exclusiveMinimum, maximum); [] when valid."""
    errors = []
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](instance) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {instance!r:.60}"]
    if "enum" in schema and instance not in schema["enum"]:
        return [f"{path}: {instance!r:.60} is not one of {schema['enum']}"]
    if _TYPES["number"](instance):
        if not math.isfinite(instance):
            errors.append(f"{path}: {instance} is not finite")
        elif "minimum" in schema and instance < schema["minimum"]:
            errors.append(f"{path}: {instance} is below {schema['minimum']}")
        elif "exclusiveMinimum" in schema and instance <= schema["exclusiveMinimum"]:
            errors.append(
                f"{path}: {instance} must exceed {schema['exclusiveMinimum']}"
            )
        elif "maximum" in schema and instance > schema["maximum"]:
            errors.append(f"{path}: {instance} is above {schema['maximum']}")
    if isinstance(instance, dict):
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                errors.extend(validate(instance[key], sub, f"{path}.{key}"))
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            errors.extend(validate(item, schema["items"], f"{path}[{i}]"))
    return errors


# --------------------------------------------------------------------------
# Measurement


@dataclass
class Measurement:
    variant: Variant
    trials: list[float] = field(default_factory=list)  # tok/s per trial
    draft_times: list[float] = field(default_factory=list)
    verify_times: list[float] = field(default_factory=list)
    peak: float = 0.0
    outputs: list[list[int]] | None = None
    stats: GenerationStats | None = None
    tokens: int = 0


def _merge(stats: Iterable[GenerationStats | None]) -> GenerationStats | None:
    stats = [s for s in stats if s is not None]
    if not stats:
        return None
    return GenerationStats(rounds=[r for s in stats for r in s.rounds])


def measure(
    pair: Pair,
    variants: list[Variant],
    prompts: list[list[int]],
    max_tokens: int,
    trials: int,
    progress: Callable[[str], None] = lambda message: None,
) -> list[Measurement]:
    """Run every variant on every prompt, ``trials`` times, interleaved: each
    prompt runs under every variant before the next prompt, in an order that
    reverses from one prompt to the next, so that a change in the machine's
    load falls on all variants alike."""
    results = [Measurement(v) for v in variants]
    for m in results:  # warm up: compilation, allocation, caches
        progress(f"warming up: {m.variant.name}")
        m.variant.run(pair, prompts[0], min(max_tokens, 8))
    for trial in range(trials):
        progress(f"trial {trial + 1}/{trials}")
        runs_of: list[list] = [[] for _ in results]
        for p, prompt in enumerate(prompts):
            order = range(len(results))
            for i in order if (trial * len(prompts) + p) % 2 == 0 else reversed(order):
                mx.reset_peak_memory()
                runs_of[i].append(results[i].variant.run(pair, prompt, max_tokens))
                results[i].peak = max(results[i].peak, mx.get_peak_memory() / 1e9)
        for m, runs in zip(results, runs_of, strict=True):
            tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
            seconds = sum(r.decode_time for r in runs)
            m.trials.append(tokens / seconds if seconds > 0 else 0.0)
            stats = _merge(r.stats for r in runs)
            if stats is not None:
                m.draft_times.append(stats.draft_time)
                m.verify_times.append(stats.verify_time)
            if m.outputs is None:
                m.outputs = [r.tokens for r in runs]
                m.stats = stats
                m.tokens = sum(len(r.tokens) for r in runs)
            elif m.outputs != [r.tokens for r in runs]:
                m.outputs = [[] for _ in runs]  # not reproducible: never lossless
    return results


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def records(
    results: list[Measurement], ceiling: float | None, synthetic: bool
) -> list[dict]:
    baseline = results[0]
    assert baseline.variant.kind == "target"
    base_rate = statistics.median(baseline.trials)
    out = []
    for m in results:
        rate = statistics.median(m.trials)
        stats = m.stats
        if m.variant.kind == "target":
            lossless, mean_length, by_position, rounds = True, 1.0, [], None
        else:
            lossless = m.outputs == baseline.outputs
            mean_length = stats.mean_accepted_length if stats.rounds else 1.0
            by_position = stats.acceptance_by_position
            rounds = len(stats.rounds)
        out.append(
            {
                "mode": m.variant.name,
                "kind": m.variant.kind,
                "synthetic": synthetic,
                "num_draft": m.variant.num_draft,
                "threshold": m.variant.threshold,
                "tok_per_s": rate,
                "tok_per_s_min": min(m.trials),
                "tok_per_s_max": max(m.trials),
                "tok_per_s_trials": m.trials,
                "speedup": rate / base_rate if base_rate > 0 else 0.0,
                "ceiling_fraction": rate / ceiling if ceiling else None,
                "mean_accepted_length": mean_length,
                "acceptance_by_position": by_position,
                "draft_time_s": _median(m.draft_times),
                "verify_time_s": _median(m.verify_times),
                "peak_memory_gb": m.peak,
                "tokens": m.tokens,
                "rounds": rounds,
                "lossless": lossless,
            }
        )
    return out


def target_bytes_per_step(model: nn.Module) -> int:
    """Bytes a decoding step reads: every parameter, except that an untied
    embedding table is read one row at a time."""
    from .machine import model_bytes

    total = model_bytes(model)
    adapter = TargetAdapter(model)
    if "lm_head" in model:
        embed = adapter.inner.embed_tokens
        total -= sum(v.nbytes for v in embed.parameters().values())
    return total


def machine_report(model: nn.Module) -> dict:
    from .machine import backend, detect_blas, measure_bandwidth, roofline

    blas = detect_blas()
    bandwidth = measure_bandwidth()
    per_step = target_bytes_per_step(model)
    return {
        "backend": backend(),
        "blas": blas.kind,
        "blas_library": blas.library,
        "blas_gflops": blas.gflops,
        "blas_slow": blas.slow,
        "bandwidth_gb_s": bandwidth / 1e9,
        "target_bytes_per_step": per_step,
        "ceiling_tok_per_s": roofline(per_step, bandwidth),
        "mlx": mx.__version__,
    }


# --------------------------------------------------------------------------
# Output


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


_NARROW_COLUMNS = {
    "mode": "mode",
    "tok/s (min-max)": "tok/s",
    "speedup": "speedup",
    "mean acc. len": "acc. len",
    "lossless": "lossless",
}


def render(report: dict, console) -> None:
    """The records as a table; below 140 columns the table keeps the main
    columns and the rest follows as one line per mode."""
    from rich.table import Table

    machine = report["machine"]
    tag = "SYNTHETIC " if report["synthetic"] else ""
    title = f"{tag}mlx-dspark benchmark: {report['pair']['label']}"
    wide = console.width >= 140
    table = Table(title=title)
    columns = [
        ("mode", "left"),
        ("tok/s (min-max)", "right"),
        ("speedup", "right"),
        ("x ceiling", "right"),
        ("mean acc. len", "right"),
        ("acceptance by position", "left"),
        ("draft / verify s", "right"),
        ("peak MB", "right"),
        ("lossless", "center"),
    ]
    shown = [c for c in columns if wide or c[0] in _NARROW_COLUMNS]
    for name, justify in shown:
        table.add_column(name if wide else _NARROW_COLUMNS[name], justify=justify)
    details = []
    for r in report["records"]:
        lossless = {True: "yes", False: "[red]NO[/]", None: "-"}[r["lossless"]]
        times = (
            "-"
            if r["draft_time_s"] is None
            else f"{r['draft_time_s']:.2f} / {r['verify_time_s']:.2f}"
        )
        by_position = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-"
        cells = {
            "mode": r["mode"],
            "tok/s (min-max)": f"{r['tok_per_s']:.1f}"
            + (f" ({r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f})" if wide else ""),
            "speedup": f"{r['speedup']:.2f}x",
            "x ceiling": _fmt(r["ceiling_fraction"]),
            "mean acc. len": f"{r['mean_accepted_length']:.2f}",
            "acceptance by position": by_position,
            "draft / verify s": times,
            "peak MB": f"{r['peak_memory_gb'] * 1000:.0f}",
            "lossless": lossless,
        }
        table.add_row(*(cells[name] for name, _ in shown))
        if not wide:
            details.append(
                f"{r['mode']}: tok/s {r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f}"
                f"; acceptance by position {by_position}; draft / verify {times} s; "
                f"peak {cells['peak MB']} MB; x ceiling {cells['x ceiling']}"
            )
    console.print(table)
    settings = report["settings"]
    trials = settings["trials"]
    lines = [
        *details,
        f"prompts: {settings['prompts']} ({settings['num_prompts']}), "
        f"max tokens {settings['max_tokens']}, {trials} trial{'s' * (trials != 1)}, "
        "greedy",
        f"backend {machine['backend']}, BLAS {machine['blas']}"
        + (
            f" ({machine['blas_gflops']:.1f} GFLOP/s matmul)"
            if machine["blas_gflops"] is not None
            else ""
        )
        + (" [slow reference BLAS]" if machine.get("blas_slow") else ""),
        f"roofline: {machine['bandwidth_gb_s']:.1f} GB/s measured, "
        f"{machine['target_bytes_per_step'] / 1e6:.1f} MB read per target step, "
        f"plain-decoding ceiling {machine['ceiling_tok_per_s']:.1f} tok/s "
        "(x ceiling: tok/s as a fraction of it)",
    ]
    if report["synthetic"]:
        lines.append(
            "SYNTHETIC: structured weights with real Qwen3 shapes, not a language "
            "model; speed and acceptance only."
        )
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix
    )
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(report: dict, path: Path) -> None:
    errors = validate(report, REPORT_SCHEMA)
    if errors:
        raise RuntimeError(f"benchmark report breaks its schema: {errors[0]}")
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))


def write_plots(report: dict, directory: Path) -> list[Path] | None:
    """PNGs of speed and acceptance; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tag = "SYNTHETIC " if report["synthetic"] else ""
    records_ = report["records"]
    names = [r["mode"] for r in records_]
    written = []

    fig, ax = plt.subplots(figsize=(max(6, len(names) * 1.1), 4))
    rates = [r["tok_per_s"] for r in records_]
    low = [r["tok_per_s"] - r["tok_per_s_min"] for r in records_]
    high = [r["tok_per_s_max"] - r["tok_per_s"] for r in records_]
    ax.bar(names, rates, yerr=[low, high], capsize=4)
    ceiling = report["machine"]["ceiling_tok_per_s"]
    if ceiling <= 2 * max(rates):
        ax.axhline(ceiling, color="red", linestyle="--", label="plain-decoding ceiling")
        ax.legend()
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{tag}{report['pair']['label']}: decoding speed")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    speed = directory / "speed.png"
    _write_atomic(speed, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    written.append(speed)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in records_:
        if r["acceptance_by_position"]:
            xs = range(1, len(r["acceptance_by_position"]) + 1)
            ax.plot(xs, r["acceptance_by_position"], marker="o", label=r["mode"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{tag}{report['pair']['label']}: acceptance by position")
    if ax.lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    acceptance = directory / "acceptance.png"
    _write_atomic(acceptance, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    written.append(acceptance)
    return written


# --------------------------------------------------------------------------
# Backend parity


class RecordingMode:
    """A chain mode that also records every round, for parity traces.

    It wraps another mode's ``propose``/``verify``; the loop is unchanged.
    """

    def __init__(self, inner: Any = None):
        self.inner = inner or ChainMode()
        self.rounds: list[dict] = []
        self._checksums: list[list[float]] = []

    def propose(self, *args, **kwargs) -> Proposal:
        proposal = self.inner.propose(*args, **kwargs)
        logits = np.array(proposal.logits[0].astype(mx.float32), dtype=np.float64)
        self._checksums = [
            [float(row.sum()), float(np.abs(row).sum()), float(row.max())]
            for row in logits
        ]
        return proposal

    def verify(self, *args, **kwargs):
        result, drafts, features = self.inner.verify(*args, **kwargs)
        self.rounds.append(
            {
                "drafts": [int(t) for t in drafts],
                "accepted": int(result.accepted),
                "checksums": self._checksums,
            }
        )
        self._checksums = []
        return result, drafts, features


def trace_prompt(
    pair: Pair, prompt: list[int], max_tokens: int, num_draft: int
) -> dict:
    recorder = RecordingMode()
    steps = speculative_generate_step(
        mx.array(prompt),
        pair.adapter,
        pair.drafter,
        num_draft=num_draft,
        max_tokens=max_tokens,
        policy=ThresholdPolicy(0.0),
        mode=recorder,
        seed=0,
    )
    tokens = [int(t) for t, _ in steps]
    return {"prompt": prompt, "tokens": tokens, "rounds": recorder.rounds}


def fingerprint(model: nn.Module) -> dict:
    adapter = TargetAdapter(model)
    head = adapter.lm_head(adapter.embed(mx.arange(min(adapter.vocab_size, 64))))
    return {
        "vocab_size": adapter.vocab_size,
        "hidden_size": adapter.hidden_size,
        "num_layers": adapter.num_layers,
        "head_checksum": float(mx.abs(head.astype(mx.float32)).sum().item()),
    }


def record_trace(pair: Pair, prompts: list[list[int]], max_tokens: int) -> dict:
    from .machine import backend

    num_draft = pair.drafter.block_size
    return {
        "format": PARITY_FORMAT,
        "pair": pair.label,
        "synthetic": pair.synthetic,
        "backend": backend(),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "max_tokens": max_tokens,
        "num_draft": num_draft,
        "fingerprint": fingerprint(pair.model),
        "prompts": [trace_prompt(pair, p, max_tokens, num_draft) for p in prompts],
    }


def _close(expected: list[float], got: list[float], rtol: float) -> bool:
    scale = max(abs(expected[1]), 1e-6)  # the absolute sum bounds the sum
    return (
        abs(expected[0] - got[0]) <= rtol * scale
        and abs(expected[1] - got[1]) <= rtol * scale
        and abs(expected[2] - got[2]) <= rtol * max(abs(expected[2]), 1.0)
    )


def first_divergence(expected: dict, got: dict, rtol: float = 1e-3) -> str | None:
    """The first place (in generation order) where two prompt traces differ."""
    exp_tokens, got_tokens = expected["tokens"], got["tokens"]
    if exp_tokens[:1] != got_tokens[:1]:
        return (
            f"round 0 (prefill), position 1: expected token {exp_tokens[0]}, "
            f"got {got_tokens[0] if got_tokens else 'none'}"
        )
    offset = 1
    for r, exp in enumerate(expected["rounds"], start=1):
        if r > len(got["rounds"]):
            return f"round {r}: expected a round, got the end of generation"
        new = got["rounds"][r - 1]
        width = max(len(exp["checksums"]), len(new["checksums"]))
        for j in range(width):
            e = exp["checksums"][j] if j < len(exp["checksums"]) else None
            g = new["checksums"][j] if j < len(new["checksums"]) else None
            if e is None or g is None or not _close(e, g, rtol):
                return (
                    f"round {r}, position {j + 1}: draft logit checksums "
                    f"(sum, abs sum, max) expected {e}, got {g}"
                )
            if j < len(exp["drafts"]) or j < len(new["drafts"]):
                ed = exp["drafts"][j] if j < len(exp["drafts"]) else None
                gd = new["drafts"][j] if j < len(new["drafts"]) else None
                if ed != gd:
                    return (
                        f"round {r}, position {j + 1}: expected draft token {ed}, "
                        f"got {gd}"
                    )
        if exp["accepted"] != new["accepted"]:
            return (
                f"round {r}: expected {exp['accepted']} accepted drafts, "
                f"got {new['accepted']}"
            )
        for j in range(exp["accepted"] + 1):
            i = offset + j
            e = exp_tokens[i] if i < len(exp_tokens) else None
            g = got_tokens[i] if i < len(got_tokens) else None
            if e != g:
                return f"round {r}, position {j + 1}: expected token {e}, got {g}"
        offset += exp["accepted"] + 1
    if len(got["rounds"]) > len(expected["rounds"]) or len(got_tokens) != len(
        exp_tokens
    ):
        return (
            f"after round {len(expected['rounds'])}: expected {len(exp_tokens)} "
            f"tokens, got {len(got_tokens)}"
        )
    return None


def read_trace(path: Path) -> dict:
    if not path.is_file():
        raise DSparkError(f"The parity trace {path} does not exist.")
    try:
        trace = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DSparkError(f"The parity trace {path} is not valid JSON.") from None
    if not isinstance(trace, dict) or trace.get("format") != PARITY_FORMAT:
        raise DSparkError(f"{path} is not an mlx-dspark parity trace.")
    try:
        for p in trace["prompts"]:
            p["prompt"], p["tokens"], p["rounds"]  # noqa: B018
        int(trace["max_tokens"]), int(trace["num_draft"])
    except (KeyError, TypeError, ValueError):
        raise DSparkError(f"The parity trace {path} is incomplete.") from None
    return trace


def check_trace(pair: Pair, trace: dict, rtol: float) -> tuple[str | None, dict]:
    """Replay ``trace``; returns the first divergence (None if none) and a summary."""
    mine = fingerprint(pair.model)
    theirs = trace["fingerprint"]
    for key in ("vocab_size", "hidden_size", "num_layers"):
        if mine[key] != theirs.get(key):
            raise DSparkError(
                f"The trace was recorded with a different model ({key} "
                f"{theirs.get(key)} there, {mine[key]} here)."
            )
    if abs(mine["head_checksum"] - theirs["head_checksum"]) > 1e-3 * abs(
        theirs["head_checksum"]
    ):
        raise DSparkError(
            "The trace was recorded with different weights (LM head checksum "
            f"{theirs['head_checksum']:.6g} there, {mine['head_checksum']:.6g} here)."
        )
    rounds = tokens = 0
    for i, expected in enumerate(trace["prompts"]):
        got = trace_prompt(
            pair, expected["prompt"], int(trace["max_tokens"]), int(trace["num_draft"])
        )
        divergence = first_divergence(expected, got, rtol)
        if divergence is not None:
            return f"prompt {i + 1}, {divergence}", {}
        rounds += len(got["rounds"])
        tokens += len(got["tokens"])
    return None, {"prompts": len(trace["prompts"]), "rounds": rounds, "tokens": tokens}


# --------------------------------------------------------------------------
# CLI


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DSparkError(
            f"{what} expects comma-separated integers, got {text!r}."
        ) from None


def _float_list(text: str, what: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DSparkError(
            f"{what} expects comma-separated numbers, got {text!r}."
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark.benchmark",
        description="Compare target-only, mlx-lm speculative and DSpark decoding.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", help="Target model path or Hugging Face repo.")
    p.add_argument("--draft-model", help="DSpark drafter path or Hugging Face repo.")
    p.add_argument(
        "--mlx-lm-draft-model",
        help="A small model for mlx-lm's own speculative decoding.",
    )
    p.add_argument(
        "--mlx-lm-num-draft", type=int, default=3, help="Drafts per round for it."
    )
    p.add_argument("--prompts", default="chat", help="chat, code, math, or a file.")
    p.add_argument(
        "--max-tokens", "-m", type=int, default=64, help="Tokens per prompt."
    )
    p.add_argument(
        "--trials", type=int, default=3, help="Passes over the prompts (median)."
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"Comma-separated modes among {', '.join(MODES)}.",
    )
    p.add_argument(
        "--fixed-n",
        help="Draft counts for the fixed modes (default: 2,4,block; 0 = plain "
        "target decoding in the DSpark loop).",
    )
    p.add_argument(
        "--useless-drafter",
        action="store_true",
        help="Replace the drafter's weights by random ones of the same shapes "
        "(a pair that never drafts well: the default policy should stop drafting).",
    )
    p.add_argument(
        "--thresholds", default="0.5", help="Confidence thresholds for threshold modes."
    )
    p.add_argument(
        "--tree-budgets", default="8,16", help="Node budgets for the tree modes."
    )
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="Use the prompts as they are, without the tokenizer's chat template.",
    )
    p.add_argument("--json", type=Path, help="Write the records as JSON here.")
    p.add_argument("--plot", type=Path, help="Write PNG plots into this folder.")
    p.add_argument(
        "--synthetic", help="Run a synthetic Qwen3-shaped pair: 0.6b, 1.7b or 4b."
    )
    p.add_argument(
        "--bits",
        type=int,
        default=4,
        help="Synthetic target: 4, 8 (quantized), 16, 32.",
    )
    p.add_argument(
        "--accept", default="chat", help="Synthetic acceptance profile: chat or math."
    )
    p.add_argument("--parity-record", type=Path, help="Record a golden greedy trace.")
    p.add_argument("--parity-check", type=Path, help="Replay a golden trace.")
    p.add_argument(
        "--parity-rtol",
        type=float,
        default=1e-3,
        help="Relative logit tolerance of --parity-check.",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="Instead of the modes: split a greedy round into its stages at each "
        "--fixed-n, and time the adapter's target forward against mlx-lm's "
        "(5 x --trials calls each).",
    )
    return p


def load_pair(args) -> Pair:
    from .loading import load

    if args.synthetic is not None:
        from .synthetic import load_synthetic

        if args.model or args.draft_model:
            raise DSparkError(
                "--synthetic builds its own pair; drop --model/--draft-model."
            )
        model, tokenizer, drafter = load_synthetic(
            args.synthetic, args.bits, args.accept
        )
        label = f"synthetic Qwen3-{args.synthetic} ({args.bits}-bit, {args.accept} acceptance)"
        if args.useless_drafter:
            make_useless(drafter)
            label += ", useless (random) drafter"
        return Pair(model, tokenizer, drafter, label, synthetic=True)
    if args.model is None:
        if args.draft_model is not None:
            raise DSparkError(
                "--draft-model needs --model (the target it was trained for)."
            )
        target_dir, drafter_dir = default_pair()
        label = f"default pair ({target_dir.name})"
    else:
        target_dir, drafter_dir, label = args.model, args.draft_model, str(args.model)
    model, tokenizer, drafter = load(target_dir, drafter_dir)
    if args.useless_drafter and drafter is not None:
        make_useless(drafter)
        label += ", useless (random) drafter"
    pair = Pair(model, tokenizer, drafter, label)
    if args.mlx_lm_draft_model:
        draft, _, _ = load(args.mlx_lm_draft_model)
        pair.mlx_lm_draft, pair.mlx_lm_draft_label = draft, args.mlx_lm_draft_model
    return pair


def make_useless(drafter: DSparkDrafter) -> None:
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


def _check_args(args) -> None:
    if args.max_tokens < 2:
        raise DSparkError(
            f"--max-tokens must be at least 2 (speed is measured after the first "
            f"token), got {args.max_tokens}."
        )
    if args.trials < 1:
        raise DSparkError(f"--trials must be at least 1, got {args.trials}.")
    if args.parity_record and args.parity_check:
        raise DSparkError("Use --parity-record or --parity-check, not both.")
    if args.parity_check is not None and not args.parity_check.is_file():
        raise DSparkError(f"The parity trace {args.parity_check} does not exist.")
    if args.synthetic is not None:
        from .synthetic import ACCEPT_PROFILES, BITS, SHAPES

        if args.synthetic not in SHAPES:
            raise DSparkError(
                f"Unknown synthetic size {args.synthetic!r}; choose {', '.join(SHAPES)}."
            )
        if args.bits not in BITS:
            raise DSparkError(f"--bits must be 4, 8, 16 or 32, got {args.bits}.")
        if args.accept not in ACCEPT_PROFILES:
            raise DSparkError(f"--accept must be chat or math, got {args.accept!r}.")
    for t in _float_list(args.thresholds, "--thresholds"):
        if not 0 <= t <= 1:
            raise DSparkError(f"--thresholds must lie in [0, 1], got {t}.")


def _main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    _check_args(args)
    console = Console(width=None if sys.stdout.isatty() else 200)
    err = Console(stderr=True)
    prompt_name, texts = load_prompts(args.prompts)
    mode_names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [n for n in mode_names if n not in MODES]
    if unknown:
        raise DSparkError(
            f"Unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}."
        )

    pair = load_pair(args)
    if pair.synthetic:
        err.print(f"SYNTHETIC pair: {pair.label}", highlight=False)
    vocab = pair.vocab_size
    prompts = [
        encode_prompt(pair.tokenizer, t, vocab, not args.ignore_chat_template)
        for t in texts
    ]

    if args.parity_record or args.parity_check:
        if pair.drafter is None:
            raise DSparkError("Parity traces need a DSpark drafter (--draft-model).")
        if args.parity_record:
            trace = record_trace(pair, prompts, args.max_tokens)
            _write_atomic(
                args.parity_record, lambda tmp: tmp.write_text(json.dumps(trace))
            )
            rounds = sum(len(p["rounds"]) for p in trace["prompts"])
            console.print(
                f"parity trace written to {args.parity_record}: {len(prompts)} prompts, "
                f"{rounds} rounds, backend {trace['backend']}",
                highlight=False,
            )
            return 0
        trace = read_trace(args.parity_check)
        divergence, summary = check_trace(pair, trace, args.parity_rtol)
        from .machine import backend

        if divergence is not None:
            raise DSparkError(
                f"Parity check failed against the {trace['backend']} trace: first "
                f"divergence at {divergence}."
            )
        console.print(
            f"parity ok: {summary['prompts']} prompts, {summary['rounds']} rounds, "
            f"{summary['tokens']} tokens match the {trace['backend']} trace "
            f"(this run: {backend()}).",
            highlight=False,
        )
        return 0

    block = pair.drafter.block_size if pair.drafter is not None else 1
    fixed = (
        _int_list(args.fixed_n, "--fixed-n")
        if args.fixed_n
        else sorted({n for n in (2, 4, block) if n <= block})
    )
    bad = [n for n in fixed if not 0 <= n <= block]
    if bad:
        raise DSparkError(f"--fixed-n values must lie in 0..{block}, got {bad[0]}.")
    if args.profile:
        from . import roundprofile

        if pair.drafter is None:
            raise DSparkError("--profile needs a DSpark drafter (--draft-model).")
        profiles = {
            n: roundprofile.profile_rounds(
                pair.adapter, pair.drafter, prompts, args.max_tokens, n
            )
            for n in fixed
        }
        overhead = roundprofile.verify_overhead(
            pair.adapter, pair.model, repeats=5 * args.trials
        )
        roundprofile.render(profiles, overhead, console)
        return 0
    budgets = _int_list(args.tree_budgets, "--tree-budgets")
    if any(b < 1 for b in budgets):
        raise DSparkError("--tree-budgets values must be at least 1.")
    settings = Settings(
        fixed,
        _float_list(args.thresholds, "--thresholds"),
        args.mlx_lm_num_draft,
        budgets,
    )
    variants = select_variants(pair, settings, mode_names)

    err.print("measuring the machine (BLAS, bandwidth) ...", highlight=False)
    machine = machine_report(pair.model)
    if err.is_terminal:
        with err.status("benchmarking") as status:
            results = measure(
                pair, variants, prompts, args.max_tokens, args.trials, status.update
            )
    else:
        results = measure(
            pair,
            variants,
            prompts,
            args.max_tokens,
            args.trials,
            lambda message: print(message, file=sys.stderr, flush=True),
        )
    report = {
        "schema": SCHEMA_VERSION,
        "synthetic": pair.synthetic,
        "pair": {
            "label": pair.label,
            "mlx_lm_draft_model": pair.mlx_lm_draft_label,
            "block_size": pair.drafter.block_size if pair.drafter else None,
        },
        "settings": {
            "prompts": prompt_name,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "trials": args.trials,
            "temperature": 0.0,
        },
        "machine": machine,
        "records": records(results, machine["ceiling_tok_per_s"], pair.synthetic),
    }
    render(report, console)
    if args.json:
        write_json(report, args.json)
        console.print(f"JSON written to {args.json}", highlight=False)
    if args.plot:
        written = write_plots(report, args.plot)
        if written is None:
            console.print(
                "Plots skipped: matplotlib is not installed (pip install 'mlx-dspark[plot]').",
                markup=False,
                highlight=False,
            )
        else:
            console.print(
                f"Plots written: {', '.join(map(str, written))}", highlight=False
            )
    if any(r["lossless"] is False for r in report["records"]):
        err.print(
            "[bold yellow]warning:[/] a mode's greedy output differs from target-only "
            "decoding (see the lossless column)."
        )
    return 0


def main(argv: list[str] | None = None) -> None:
    code = run_cli(lambda: _main(argv))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
