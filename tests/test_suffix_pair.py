"""Suffix drafts with a drafter: each round the suffix draft verified as it
is, the drafter's block or a plain step, chosen from measured costs and each
kind's acceptance in this generation; the output stays the target's (greedy,
sampled, seeded)."""

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
import pytest
from test_copying import REPEATING_PROMPTS, repeated_walk
from test_greedy import target_greedy
from test_sampling import CONFIGS, SEEDS, chi_square, chi_square_critical, exact_joint
from test_sampling import sample_first_three as sample_with
from test_seed import MAX_TOKENS as SEED_TOKENS
from test_seed import PROMPT as SEED_PROMPT
from test_seed import SEEDS as SEED_SEEDS
from test_seed import SETTINGS, kwargs, mlx_lm_tokens

from mlx_dspark import stream_generate
from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.adaptive import AdaptivePolicy
from mlx_dspark.policy.costs import RoundCosts
from mlx_dspark.policy.policies import MonitoredPolicy
from mlx_dspark.proposers.base import Proposal, point_mass
from mlx_dspark.proposers.copying import own_proposer
from mlx_dspark.proposers.suffix import (
    SuffixPairProposer,
    SuffixProposer,
    suffix_pair_proposer,
)
from mlx_dspark.proposers.suffix_store import phrase_store, write_phrases
from mlx_dspark.targets.adapter import TargetAdapter

MIXED_PROMPTS = [*REPEATING_PROMPTS, [3, 14, 15, 9], [13, 5, 5, 21, 2, 17]]


@pytest.fixture(scope="module")
def pair(pair_factory):
    return pair_factory(markov_head_type="vanilla", block_size=8)


@dataclass
class FixedCosts(RoundCosts):
    """Round costs that do not depend on the machine: a plain round 1, a
    verify of ``q`` tokens ``1 + 0.05 (q - 1)``, plus ``draft`` for the
    drafter's pass (none for a suffix draft verified as it is). The policy's
    choices then depend on acceptance only."""

    draft: float = 0.4

    def costs(self, cap: int, drafter: bool = True) -> list[float]:
        extra = self.draft if drafter else 0.0
        return [1.0] + [extra + 1.0 + 0.05 * n for n in range(1, cap + 1)]

    def optimistic(self, cap: int) -> list[float]:
        return self.costs(cap)


def pair_loop(model, drafter, prompt, proposer, policy, max_tokens=64):
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    stats = GenerationStats()
    steps = speculative_generate_step(
        mx.array(prompt), target, proposer, num_draft=drafter.block_size,
        max_tokens=max_tokens, policy=policy, stats=stats,
    )  # fmt: skip
    return [t for t, _ in steps], stats


class Contrary:
    """A drafter that never agrees with the target's greedy choice: the
    drafter's own tokens shifted by one, each drawn from a point mass on
    itself (so verification stays exact)."""

    def __init__(self, inner, vocab_size):
        self.inner, self.vocab_size = inner, vocab_size

    def make_state(self):
        return self.inner.make_state()

    def propose(self, state, round):
        proposal = self.inner.propose(state, round)
        tokens = (proposal.tokens + 1) % self.vocab_size
        return Proposal(tokens, point_mass(tokens, self.vocab_size, mx.float32))


def test_greedy_identical_and_every_kind_of_round_occurs(pair):
    model, _, drafter, *_ = pair
    vocab = drafter.config.vocab_size
    kinds = set()
    for contrary in (False, True):
        for prompt in MIXED_PROMPTS:
            inner = own_proposer(drafter)
            if contrary:
                inner = Contrary(inner, vocab)
            proposer = SuffixPairProposer(inner, vocab, longest=12)
            policy = AdaptivePolicy(costs=FixedCosts(), suffix=True)
            tokens, stats = pair_loop(model, drafter, prompt, proposer, policy)
            assert tokens == target_greedy(model, prompt, max_tokens=64), prompt
            kinds |= set(stats.by_kind())
    assert {"plain", "own", "copy"} <= kinds, kinds


def test_a_drafter_that_never_agrees_is_left_for_suffix_drafts(pair):
    """With a drafter whose drafts are all rejected, the pair drafts from it
    only while warming up, and needs no more rounds than suffix drafts
    alone."""
    model, _, drafter, *_ = pair
    vocab = drafter.config.vocab_size
    for prompt in MIXED_PROMPTS:
        inner = Contrary(own_proposer(drafter), vocab)
        proposer = SuffixPairProposer(inner, vocab, longest=12)
        policy = AdaptivePolicy(costs=FixedCosts(), suffix=True)
        tokens, stats = pair_loop(model, drafter, prompt, proposer, policy)
        assert tokens == target_greedy(model, prompt, max_tokens=64)
        kinds = stats.by_kind()
        own = kinds.get("own")
        assert own is None or (own.rounds <= 4 and own.kept == own.rounds), kinds
        alone = SuffixProposer(vocab)
        solo = AdaptivePolicy(costs=FixedCosts(draft=0.0))
        tokens, alone_stats = pair_loop(model, drafter, prompt, alone, solo)
        assert tokens == target_greedy(model, prompt, max_tokens=64)
        assert len(stats.rounds) <= len(alone_stats.rounds) + 4, prompt


def test_poor_suffix_drafts_are_left_for_the_drafter(pair):
    """The other way round: where the drafter is good and the copies poor
    (suffix drafts that a point mass on a wrong token replaces), copy rounds
    stop after warm-up and the drafter's block takes the rounds."""
    model, _, drafter, *_ = pair
    vocab = drafter.config.vocab_size

    class WrongCopies(SuffixPairProposer):
        def draft(self, state, tokens, longest):
            found = super().draft(state, tokens, longest)
            return replace(found, tokens=(found.tokens + 1) % vocab)

    prompt = REPEATING_PROMPTS[1]
    proposer = WrongCopies(own_proposer(drafter), vocab, longest=12)
    policy = AdaptivePolicy(costs=FixedCosts(draft=0.1), suffix=True)
    tokens, stats = pair_loop(model, drafter, prompt, proposer, policy)
    assert tokens == target_greedy(model, prompt, max_tokens=64)
    kinds = stats.by_kind()
    assert kinds["own"].rounds > 3 * kinds.get("copy", kinds["own"]).rounds // 2
    assert kinds.get("copy") is None or kinds["copy"].rounds <= 6, kinds


def test_stream_generate_with_a_drafter_and_suffix_drafts_is_the_target(pair):
    model, tokenizer, drafter, *_ = pair
    kinds = set()
    for prompt in MIXED_PROMPTS:
        expected = target_greedy(model, prompt, max_tokens=48)
        for extra in ({}, {"num_draft": 3}):
            responses = list(
                stream_generate(
                    model, tokenizer, drafter, prompt, max_tokens=48,
                    suffix=True, **extra,
                )
            )  # fmt: skip
            assert [r.token for r in responses] == expected, (prompt, extra)
            rounds = responses[-1].stats.rounds
            if extra:  # a fixed count: every round verifies up to 3 drafts
                assert all(0 < r.verified <= 3 for r in rounds if r.drafted)
            kinds |= set(responses[-1].stats.by_kind())
    assert {"own", "copy"} <= kinds, kinds
    with pytest.raises(DSparkError, match="chains only") as caught:
        list(
            stream_generate(
                model, tokenizer, drafter, [1, 2], suffix=True, tree_budget=6
            )
        )
    assert "\n" not in str(caught.value)


def test_the_phrase_store_is_the_global_part(pair, tmp_path):
    """A drafter's ``phrases.npy`` store becomes a read-only global suffix
    store: drafts from it are offered as the phrase store's copies."""
    model, _, drafter, *_ = pair
    walk = repeated_walk(model, 14)
    write_phrases(tmp_path / "phrases.npy", [walk, [1, 2, 3]])
    original = getattr(drafter, "phrase_store", None)
    drafter.phrase_store = global_store = phrase_store(tmp_path / "phrases.npy")
    try:
        assert [d.tolist() for d in global_store.documents()] == [walk, [1, 2, 3]]
        proposer = suffix_pair_proposer(drafter, 12)
        state = proposer.make_state()
        offers = proposer.offer(state, walk[:4], 8)
        assert offers[0].phrases and offers[0].declinable
        assert offers[0].payload.tokens.tolist() == walk[4 : 4 + len(offers[0].payload)]
        prompt = walk[:3]
        policy = AdaptivePolicy(costs=FixedCosts(), suffix=True)
        tokens, stats = pair_loop(model, drafter, prompt, proposer, policy, 32)
        assert tokens == target_greedy(model, prompt, max_tokens=32)
        assert any(r.phrases_offered and r.drafted for r in stats.rounds)
        assert global_store.num_documents == 2  # read, never written
    finally:
        drafter.phrase_store = original


@pytest.mark.parametrize("params", CONFIGS, ids=["t0.7-p0.9-k8", "t1"])
def test_sampling_exact_with_suffix_drafts_and_a_drafter(pair_factory, params):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    prompt = repeated_walk(model)
    joint = exact_joint(model, params, prompt)
    proposer = suffix_pair_proposer(drafter, 6)
    samples, stats = sample_with(
        model, drafter, params, policy=MonitoredPolicy, proposer=proposer,
        prompt=prompt, max_tokens=6,
    )  # fmt: skip
    stat, dof = chi_square(samples, joint, SEEDS)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    copied = [r for r in stats.rounds if r.drafted and r.copy_offered]
    own = [r for r in stats.rounds if r.drafted and not r.copy_offered]
    assert len(copied) > SEEDS // 4 and own, (len(copied), len(own))
    kept = [r.accepted for r in copied]
    assert 0 < np.mean(kept) and min(kept) == 0, kept


@pytest.mark.parametrize("extra", [{}, {"num_draft": 3}], ids=["adaptive", "n3"])
def test_seeded_output_equals_mlx_lm(pair_factory, extra):
    model, tokenizer, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=5
    )
    kinds = set()
    for name in ("t1", "t0.7-p0.9"):
        params = SETTINGS[name]
        for seed in SEED_SEEDS:
            responses = list(
                stream_generate(
                    model, tokenizer, drafter, mx.array(SEED_PROMPT),
                    max_tokens=SEED_TOKENS, seed=seed, suffix=True,
                    **kwargs(params), **extra,
                )
            )  # fmt: skip
            expected = mlx_lm_tokens(model, tokenizer, params, seed)
            assert [r.token for r in responses] == expected, (name, seed)
            kinds |= set(responses[-1].stats.by_kind())
    assert "copy" in kinds, kinds
