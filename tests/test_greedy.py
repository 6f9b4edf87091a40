"""Greedy DSpark output equals the target's own greedy decoding, token for token."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import HEADS, head_id
from mlx_lm.generate import generate_step
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.utils import load_tokenizer

from mlx_dspark import stream_generate
from mlx_dspark.proposers.copying import pair_proposer

PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 11, 9], [0], [13, 5, 5, 21, 2, 17]]
MAX_TOKENS = 64


def target_greedy(model, prompt, max_tokens=MAX_TOKENS):
    tokens = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    return [int(t) for t, _ in tokens]


def dspark_tokens(model, tokenizer, drafter, prompt, **kwargs):
    responses = list(stream_generate(model, tokenizer, drafter, prompt, **kwargs))
    return [r.token for r in responses], responses[-1]


@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_greedy_identical_every_head_and_length(pair_factory, head):
    model, tokenizer, drafter, *_ = pair_factory(markov_head_type=head, block_size=8)
    rounds = []
    for prompt in PROMPTS:
        expected = target_greedy(model, prompt)
        for num_draft in range(1, 9):
            for threshold in (0.0, 0.5):
                tokens, last = dspark_tokens(
                    model,
                    tokenizer,
                    drafter,
                    prompt,
                    max_tokens=MAX_TOKENS,
                    num_draft=num_draft,
                    confidence_threshold=threshold,
                )
                assert tokens == expected, (prompt, num_draft, threshold)
                assert last.finish_reason == "length"
                assert last.generation_tokens == MAX_TOKENS
                if num_draft == 8 and threshold == 0.0:
                    rounds.extend(last.stats.rounds)
    accepted = [r.accepted for r in rounds]
    mean_length = np.mean(accepted) + 1
    assert 2.0 <= mean_length <= 8.0
    assert min(accepted) < 8 and max(accepted) > 0


def test_confidence_threshold_cuts_blocks(pair_factory):
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    _, off = dspark_tokens(model, tokenizer, drafter, PROMPTS[0], max_tokens=MAX_TOKENS)
    _, on = dspark_tokens(
        model,
        tokenizer,
        drafter,
        PROMPTS[0],
        max_tokens=MAX_TOKENS,
        confidence_threshold=0.5,
    )
    assert all(r.verified == r.drafted for r in off.stats.rounds)
    cut = [r for r in on.stats.rounds if r.verified < r.drafted]
    assert cut, "a threshold of 0.5 should cut some blocks on this pair"


@pytest.mark.parametrize("head", ["vanilla", None], ids=head_id)
def test_stop_token_inside_accepted_block(pair_factory, head):
    model, tokenizer, drafter, target_dir, *_ = pair_factory(
        markov_head_type=head, block_size=8
    )
    prompt = PROMPTS[2]
    # Always draft a whole block: the default policy may decode plainly on a
    # busy machine, and then no block is accepted.
    drafting = {"max_tokens": MAX_TOKENS, "num_draft": drafter.block_size}
    responses = list(stream_generate(model, tokenizer, drafter, prompt, **drafting))
    # A stop token that the target accepted as a draft in the middle of a block.
    stop = next(
        r.token
        for previous, r in zip(responses[3:], responses[4:-1], strict=False)
        if r.from_draft and previous.from_draft
    )
    tokenizer = load_tokenizer(target_dir)
    tokenizer.add_eos_token(str(stop))
    ours = list(stream_generate(model, tokenizer, drafter, prompt, **drafting))
    theirs = list(
        mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    )
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)
    assert ours[-1].finish_reason == theirs[-1].finish_reason == "stop"
    assert ours[-1].token == stop


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 9, 17])
def test_max_tokens_exact(pair_factory, max_tokens):
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    ours = list(
        stream_generate(model, tokenizer, drafter, PROMPTS[1], max_tokens=max_tokens)
    )
    theirs = list(
        mlx_lm_stream_generate(model, tokenizer, PROMPTS[1], max_tokens=max_tokens)
    )
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert ours[-1].generation_tokens == max_tokens
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)


class SkipEveryOtherRound:
    """A policy whose round cap drops to 0 every other round (drafter skipped)."""

    def __init__(self):
        self.rounds = 0

    def round_cap(self, cap, copy=False, phrases=False):
        self.rounds += 1
        return 0 if self.rounds % 2 else cap

    def draft_length(self, proposal, cap):
        return cap


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_rounds_without_drafting_keep_the_draft_context(pair_factory, mode):
    from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
    from mlx_dspark.decoding.modes import TreeMode
    from mlx_dspark.targets.adapter import TargetAdapter

    model, _, drafter, *_ = pair_factory(block_size=8)
    stats = GenerationStats()
    tokens = speculative_generate_step(
        mx.array(PROMPTS[0]),
        TargetAdapter(model, drafter.config.target_layer_ids),
        pair_proposer(drafter),
        num_draft=drafter.block_size,
        max_tokens=MAX_TOKENS,
        policy=SkipEveryOtherRound(),
        mode=TreeMode(8) if mode == "tree" else None,
        stats=stats,
    )
    assert [t for t, _ in tokens] == target_greedy(model, PROMPTS[0])
    assert any(r.drafted == 0 for r in stats.rounds)
    assert any(r.accepted > 0 for r in stats.rounds)
