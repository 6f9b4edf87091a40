"""Where a round's time goes, and what the target adapter adds to a forward.

:func:`profile_rounds` runs greedy chain rounds of its own on the given
prompts, with an ``mx.eval`` after every stage so that each stage's time is
its real compute (MLX is lazy: without the barriers a stage's work would be
billed to whichever later stage first reads its result). The rounds commit
the same tokens as the generation loop with a fixed draft length; the
remainder of a round beyond its stages is host synchronisation and Python.
The loop's own, uninstrumented round time is reported beside it.

:func:`verify_overhead` times the adapter's target forward (logits and
tapped features) against mlx-lm's own ``model(tokens, cache=...)``,
interleaved, at a few query lengths.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..decoding.loop import (
    GenerationStats,
    ThresholdPolicy,
    prefill,
    speculative_generate_step,
)
from ..decoding.verify import verdict
from ..proposers.copying import pair_proposer
from ..proposers.dspark import DSparkDrafter
from ..sampling.processing import SamplingParams
from ..targets.adapter import TargetAdapter

STAGES = (
    "drafter backbone",
    "sequential head",
    "confidence head",
    "policy",
    "target forward",
    "acceptance",
    "cache rollback/commit",
    "host sync / Python",
)
VERIFY_SIZES = (1, 2, 4, 8)


def _timed(totals: dict[str, float], stage: str, fn, *args):
    """Run ``fn(*args)``, evaluate its arrays and bill the time to ``stage``."""
    tic = time.perf_counter()
    out = fn(*args)
    mx.eval(out)
    totals[stage] += time.perf_counter() - tic
    return out


def _draft_chain(drafter, hidden, anchor, cap, params):
    proposal = drafter.propose(hidden, anchor, cap, params, None, confidence=False)
    return proposal.tokens, proposal


def _verdict(drafts, proposal, logits, params, rng):
    result = verdict(drafts, proposal.logits[0, : len(drafts)], logits[0], params, rng)
    return result.accepted, result


def _commit(target, cache, features, verified, accepted):
    target.rollback(cache, verified - accepted)
    return features[:, : accepted + 1]


def _rounds(
    target: TargetAdapter,
    drafter: DSparkDrafter,
    prompt: list[int],
    max_tokens: int,
    num_draft: int,
    totals: dict[str, float],
) -> int:
    """Instrumented greedy rounds on one prompt; returns the number of rounds."""
    params, policy = SamplingParams(), ThresholdPolicy(0.0)
    rng = np.random.default_rng(0)
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    logits, context = prefill(target, mx.array(prompt), cache)
    anchor = int(mx.argmax(logits).item())
    produced, start, rounds = 1, len(prompt), 0
    while produced < max_tokens:
        cap = min(num_draft, max_tokens - produced - 1)
        if cap < 1:
            break
        tic = time.perf_counter()
        spent = sum(totals.values())
        anchor_array = mx.array([anchor])
        block = drafter.block_tokens(anchor_array)
        hidden = _timed(
            totals, "drafter backbone", drafter, block, start, context, draft_cache
        )
        _, proposal = _timed(
            totals,
            "sequential head",
            _draft_chain,
            drafter,
            hidden,
            anchor_array,
            cap,
            params,
        )
        proposal.confidence = _timed(
            totals,
            "confidence head",
            drafter.chain_confidence,
            hidden,
            anchor_array,
            proposal.tokens,
        )
        n = _timed(totals, "policy", policy.draft_length, proposal, cap)
        drafts = np.array(proposal.tokens[0, :n]).tolist()
        tokens = mx.array([[anchor, *drafts]])
        logits, features = _timed(totals, "target forward", target, tokens, cache)
        accepted, result = _timed(
            totals,
            "acceptance",
            _verdict,
            np.array(drafts, dtype=np.int64),
            proposal,
            logits,
            params,
            rng,
        )
        context = _timed(
            totals,
            "cache rollback/commit",
            _commit,
            target,
            cache,
            features,
            n,
            accepted,
        )
        produced += accepted + 1
        start += accepted + 1
        anchor = result.next_token
        rounds += 1
        elapsed = time.perf_counter() - tic
        totals["host sync / Python"] += elapsed - (sum(totals.values()) - spent)
    return rounds


def _loop_rounds(
    target: TargetAdapter,
    drafter: DSparkDrafter,
    prompt: list[int],
    max_tokens: int,
    num_draft: int,
    stats: GenerationStats,
) -> None:
    for _ in speculative_generate_step(
        mx.array(prompt),
        target,
        pair_proposer(drafter),
        num_draft=num_draft,
        max_tokens=max_tokens,
        policy=ThresholdPolicy(0.0),
        seed=0,
        stats=stats,
    ):
        pass


def profile_rounds(
    target: TargetAdapter,
    drafter: DSparkDrafter,
    prompts: Sequence[list[int]],
    max_tokens: int,
    num_draft: int,
) -> dict[str, float]:
    """Milliseconds per round for each of :data:`STAGES`, their sum
    (``"round (instrumented)"``) and the loop's own round time
    (``"round (generation loop)"``), greedy, ``num_draft`` drafts a round.

    Instrumented and loop runs alternate prompt by prompt, so that machine
    noise hits both alike, after a short unmeasured warm-up.
    """
    totals = dict.fromkeys(STAGES, 0.0)
    _rounds(target, drafter, prompts[0], min(max_tokens, 8), num_draft, totals)
    totals, rounds, stats = dict.fromkeys(STAGES, 0.0), 0, GenerationStats()
    for prompt in prompts:
        rounds += _rounds(target, drafter, prompt, max_tokens, num_draft, totals)
        _loop_rounds(target, drafter, prompt, max_tokens, num_draft, stats)
    out = {stage: 1e3 * t / max(rounds, 1) for stage, t in totals.items()}
    out["round (instrumented)"] = sum(out[s] for s in STAGES)
    busy = sum(r.draft_time + r.verify_time for r in stats.rounds)
    out["round (generation loop)"] = 1e3 * busy / max(len(stats.rounds), 1)
    out["rounds"] = rounds
    return out


def verify_overhead(
    target: TargetAdapter,
    model: nn.Module,
    context: int = 64,
    sizes: Sequence[int] = VERIFY_SIZES,
    repeats: int = 20,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Median milliseconds of the adapter's forward and of mlx-lm's own call,
    per query length, measured interleaved (alternating which goes first) on
    one cache holding ``context`` random tokens; each call is rolled back.
    ``ratio`` is the median over repeats of the two adjacent calls' ratio,
    which cancels slow changes in machine load."""
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    cache = target.make_cache()
    mx.eval(target(mx.array(rng.integers(0, vocab, (1, context))), cache))
    queries = {q: mx.array(rng.integers(0, vocab, (1, q))) for q in sizes}

    def ours(tokens):
        mx.eval(target(tokens, cache))

    def theirs(tokens):
        mx.eval(model(tokens, cache=cache))

    times = {(q, f): [] for q in sizes for f in ("adapter", "mlx-lm")}
    for r in range(repeats + 1):
        for q in sizes:
            calls = [("adapter", ours), ("mlx-lm", theirs)]
            for name, fn in calls if r % 2 else calls[::-1]:
                tic = time.perf_counter()
                fn(queries[q])
                elapsed = time.perf_counter() - tic
                target.rollback(cache, q)
                if r:  # the first pass is a warm-up
                    times[q, name].append(elapsed)
    rows = []
    for q in sizes:
        ours_ms, theirs_ms = (
            np.array(times[q, f]) * 1e3 for f in ("adapter", "mlx-lm")
        )
        rows.append(
            {
                "query_tokens": q,
                "adapter_ms": float(np.median(ours_ms)),
                "mlx_lm_ms": float(np.median(theirs_ms)),
                "ratio": float(np.median(ours_ms / theirs_ms)),
            }
        )
    return rows
