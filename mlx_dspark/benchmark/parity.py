"""Backend parity: record a golden greedy trace on one backend, check it on another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..decoding.loop import ThresholdPolicy, speculative_generate_step
from ..decoding.modes import ChainMode
from ..errors import DSparkError
from ..proposers.base import Proposal
from ..proposers.copying import pair_proposer
from ..targets.adapter import TargetAdapter
from .modes import Pair

PARITY_FORMAT = "mlx-dspark-parity/1"


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
        pair_proposer(pair.drafter),
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
    from ..machine import backend

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
