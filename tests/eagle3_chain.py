"""A chain-drafting harness for EAGLE-3 drafters, independent of the
generation loop: prefill, then rounds of draft, verify (ChainMode, the loop's
own verification) and extend, as DeepSpec's evaluator runs them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_dspark.decoding.modes import ChainMode
from mlx_dspark.decoding.verify import draw
from mlx_dspark.proposers.eagle3 import Eagle3Drafter
from mlx_dspark.sampling.coupled import TokenKeys, mlx_lm_token
from mlx_dspark.sampling.processing import SamplingParams, probabilities
from mlx_dspark.targets.adapter import TargetAdapter


def generate_chain(
    model,
    drafter: Eagle3Drafter,
    prompt: list[int],
    max_new: int,
    n_draft: int,
    params: SamplingParams = SamplingParams(),
    seed: int = 0,
    rounds: list | None = None,
    coupled: bool = False,
) -> tuple[list[int], list[int]]:
    """``(tokens after the prompt, committed tokens per round)``; rounds run
    while at most ``max_new`` tokens are out, as in DeepSpec's evaluator loop
    (which then keeps the first ``max_new``). ``coupled``: Gumbel-coupled
    sampling with mlx-lm's token keys for ``seed`` (the output is then
    mlx-lm's own); else residual rejection sampling."""
    if coupled:
        rng = TokenKeys.from_seed(seed, params)
    else:
        rng = np.random.default_rng(seed)
    key = mx.random.key(seed)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    cache = target.make_cache()
    logits, features = target(mx.array([prompt]), cache)
    if params.greedy:
        first = int(mx.argmax(logits[0, -1]).item())
    elif coupled:
        first = int(mlx_lm_token(logits[0, -1], params, rng.take(1)[0]).item())
    else:
        first = draw(probabilities(logits[0, -1], params), rng)
    draft_cache = drafter.make_cache()
    drafter.extend(draft_cache, features, mx.array([prompt[1:] + [first]]), 0)
    out, lengths, start, anchor = [first], [], len(prompt), first
    mode = ChainMode()
    while len(out) <= max_new:
        key, sub = mx.random.split(key)
        if coupled:
            sub = rng.peek(n_draft)
        proposal = drafter.draft(
            draft_cache, mx.array([anchor]), start, n_draft, params, sub
        )
        verdict, drafts, committed = mode.verify(
            target, cache, anchor, proposal, n_draft, params, rng
        )
        new = drafts[: verdict.accepted] + [verdict.next_token]
        if rounds is not None:
            rounds.append((proposal, verdict))
        drafter.extend(draft_cache, committed, mx.array([new]), start)
        out += new
        lengths.append(len(new))
        start += len(new)
        anchor = new[-1]
    return out, lengths
