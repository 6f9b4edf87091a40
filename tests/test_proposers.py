"""Proposers: any proposer goes through the one loop, and proposers mixed
within one generation (context copies, the phrase store, the drafter and an
autoregressive proposer with its own cache) stay lossless."""

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from test_copying import copy_bias
from test_greedy import target_greedy
from test_phrases import store_offering, stored, stranger_pair, walks
from test_sampling import (
    SEEDS,
    chi_square,
    chi_square_critical,
    exact_joint,
    sample_first_three,
)
from test_seed import MAX_TOKENS, PROMPT, mlx_lm_tokens, served, served_as

from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.decoding.modes import TreeMode
from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.policies import MonitoredPolicy
from mlx_dspark.proposers.base import Backlog, Offer, Proposal, Round
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.sampling.coupled import mlx_lm_draw
from mlx_dspark.sampling.processing import SamplingParams, processed_logits
from mlx_dspark.serving import BatchEngine, EngineConfig, GenerationRequest
from mlx_dspark.targets.adapter import TargetAdapter


@dataclass
class BigramCache:
    """An autoregressive proposer's own cache: per position, the token after
    it (committed, then its own drafts) and the committed features."""

    tokens: list[int] = field(default_factory=list)
    features: list[mx.array] = field(default_factory=list)


class BigramProposer:
    """An autoregressive proposer (EAGLE-3's shape, a bigram table's brains):
    it pairs the feature of position p with the token at p + 1, keeps its
    drafts in its cache until the next round trims them, and drafts one
    token at a time from ``table[previous token]``. ``wrong``: it reports
    uniform rows instead of those it drew from (a wrong proposal)."""

    def __init__(self, table: mx.array, wrong: bool = False):
        self.table, self.wrong = table, wrong
        self.caches: list[BigramCache] = []

    def make_state(self) -> BigramCache:
        self.caches.append(BigramCache())
        return self.caches[-1]

    def propose(self, state: BigramCache, round: Round) -> Proposal:
        following = round.following()
        first = round.start - len(following)
        del state.tokens[first:]  # last round's drafts: stale
        assert state.tokens == round.tokens[1 : first + 1], "features fed out of order"
        state.tokens += following
        if round.features is not None:
            assert round.features.shape[1] == len(following)
            state.features.append(round.features)
        params, key = round.params, round.key
        if isinstance(key, list):
            keys = key
        elif params.greedy:
            keys = [None] * round.cap
        else:
            keys = list(mx.random.split(key, round.cap))
        prev, tokens, rows = round.anchor, [], []
        for k in range(round.cap):
            row = self.table[prev][None]
            if params.greedy:
                token, drawn = mx.argmax(row, axis=-1), row
            elif isinstance(key, list):  # coupled: mlx-lm's draw with its keys
                token, drawn = mlx_lm_draw(row, params, keys[k])
            else:
                drawn = processed_logits(row, params)
                token = mx.random.categorical(drawn, key=keys[k])
            prev = int(token.item())
            state.tokens.append(prev)
            tokens.append(prev)
            rows.append(mx.zeros_like(drawn) if self.wrong else drawn)
        return Proposal(mx.array([tokens]), mx.concatenate(rows)[None])


@dataclass
class Turns:
    backlogs: list[Backlog]
    turn: int = 0


class TakingTurns:
    """Proposers taking turns round by round, each with its own state and
    the features committed since its last turn; ``taken`` counts the turns."""

    def __init__(self, *proposers):
        self.proposers = proposers
        self.taken: list[int] = []

    def make_state(self) -> Turns:
        return Turns([Backlog(p.make_state()) for p in self.proposers])

    def offer(self, state: Turns, tokens: list[int], longest: int) -> list[Offer]:
        i = state.turn % len(self.proposers)
        offer = getattr(self.proposers[i], "offer", None)
        if offer is None:
            return [Offer(longest)]
        return offer(state.backlogs[i].inner, tokens, longest)

    def propose(self, state: Turns, round: Round) -> Proposal:
        i = state.turn % len(self.proposers)
        state.turn += 1
        self.taken.append(i)
        for j, backlog in enumerate(state.backlogs):
            if j != i:
                backlog.skip(round)
        backlog = state.backlogs[i]
        return self.proposers[i].propose(backlog.inner, backlog.take(round))


def bigram_table(model) -> mx.array:
    """The target's next-token logits after each token alone: the structured
    target's map without its context-dependent part, so its drafts are
    often, not always, kept."""
    vocab = model.args.vocab_size
    table = model(mx.arange(vocab)[:, None])[:, -1].astype(mx.float32)
    mx.eval(table)  # a server thread reads it
    return table


def mixed_pair(pair_factory, **spec):
    """A structured target, a drafter of another seed's pair that copies from
    the context and from a store of the target's own text, and a bigram
    proposer: every kind of round occurs."""
    model, tokenizer, drafter = stranger_pair(pair_factory, **spec)
    drafter.phrase_store = stored(walks(model, range(1, 29)))
    return model, drafter, BigramProposer(bigram_table(model))


def kept_by_turn(proposer, stats):
    """Accepted drafts and verified drafts per proposer's turn."""
    drafted = [r for r in stats.rounds if r.drafted]
    assert len(drafted) == len(proposer.taken)
    kept = {}
    for turn, r in zip(proposer.taken, drafted, strict=True):
        kept.setdefault(turn, []).append((r.accepted, r.verified))
    return kept


@pytest.mark.parametrize("as_is", [False, True], ids=["biased", "as-is"])
def test_greedy_identical_with_mixed_proposers(pair_factory, as_is):
    model, drafter, bigram = mixed_pair(pair_factory, block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompts = [[13, 5, 21], [1, 2, 3, 4, 1, 2, 3], [7, 8, 7, 8, 7], [20, 4, 11, 9]]
    rounds, kept = [], {0: [], 1: []}
    with copy_bias(drafter, 1e3):
        for prompt in prompts:
            mixed = TakingTurns(pair_proposer(drafter, 12, as_is), bigram)
            stats = GenerationStats()
            steps = speculative_generate_step(
                mx.array(prompt), target, mixed, num_draft=4, max_tokens=48,
                policy=MonitoredPolicy(), stats=stats,
            )  # fmt: skip
            tokens = [t for t, _ in steps]
            assert tokens == target_greedy(model, prompt, max_tokens=48), prompt
            rounds += stats.rounds
            for turn, pairs in kept_by_turn(mixed, stats).items():
                kept[turn] += pairs
            # The bigram proposer was given every committed position once, in
            # order, with its own features: the target's.
            cache = bigram.caches[-1]
            features = mx.concatenate(cache.features, axis=1)
            n = features.shape[1]
            whole = mx.array([[*prompt, *tokens][:n]])
            _, expected = target(whole, target.make_cache())
            assert mx.allclose(features, expected, atol=1e-3)
    kinds = Counter(
        "phrases" if r.phrases_offered else "copy" if r.copy_offered else "own"
        for r in rounds
        if r.drafted
    )
    assert min(kinds["copy"], kinds["phrases"], kinds["own"]) > 0, kinds
    for turn in (0, 1):  # both kinds of proposer: kept often, not always
        accepted = [a for a, _ in kept[turn]]
        assert 0 < np.mean(accepted) and any(a < v for a, v in kept[turn]), turn
    assert max(a for a, _ in kept[1]) > 1


@pytest.mark.parametrize("sampling", ["residual", "coupled"])
def test_sampling_exact_with_mixed_proposers(pair_factory, sampling):
    model, drafter, _ = mixed_pair(
        pair_factory, markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = SamplingParams(temperature=1.0)
    prompt = [3, 14, 15]
    drafter.phrase_store = store_offering(model, prompt)
    joint = exact_joint(model, params, prompt)
    table = bigram_table(model)

    def sample(bigram):
        mixed = TakingTurns(pair_proposer(drafter), BigramProposer(table, bigram))
        return sample_first_three(
            model, drafter, params, prompt=prompt, proposer=mixed,
            policy=MonitoredPolicy, sampling=sampling, max_tokens=8,
        ), mixed  # fmt: skip

    with copy_bias(drafter, 40.0):
        (samples, stats), mixed = sample(False)
        stat, dof = chi_square(samples, joint, SEEDS)
        assert dof >= 5
        assert stat < chi_square_critical(dof), (stat, dof)
        kept = kept_by_turn(mixed, stats)
        assert len(kept[1]) > SEEDS // 10 and len(kept[0]) == SEEDS
        assert any(r.phrases_offered for r in stats.rounds)
        if sampling == "residual":  # coupled never reads the rows
            (wrong, _), _ = sample(True)
            assert chi_square(wrong, joint, SEEDS)[0] > chi_square_critical(dof)


def test_seeded_mixed_proposers_keep_mlx_lm_output(pair_factory):
    model, tokenizer, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    _, drafter, bigram = mixed_pair(
        pair_factory, markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    with copy_bias(drafter, 40.0):
        for seed in (0, 1, 7):
            mixed = TakingTurns(pair_proposer(drafter), bigram)
            steps = speculative_generate_step(
                mx.array(PROMPT), target, mixed, params=params, num_draft=4,
                max_tokens=MAX_TOKENS, seed=seed, policy=MonitoredPolicy(),
            )  # fmt: skip
            expected = mlx_lm_tokens(model, tokenizer, params, seed)
            assert [t for t, _ in steps] == expected, seed
            assert set(mixed.taken) == {0, 1}


def test_trees_refuse_a_chain_only_proposer(pair_factory):
    model, drafter, bigram = mixed_pair(pair_factory, block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    steps = speculative_generate_step(
        mx.array([1, 2, 3]), target, bigram, num_draft=4, max_tokens=8,
        mode=TreeMode(6),
    )  # fmt: skip
    with pytest.raises(DSparkError, match="BigramProposer proposes chains only"):
        list(steps)


def test_server_takes_any_proposer(pair_factory):
    spec = {"markov_head_type": "vanilla", "sharpness": 0.6, "block_size": 4}
    model, tokenizer, *_ = pair_factory(**spec)
    _, drafter, bigram = mixed_pair(pair_factory, **spec)
    settings = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)]
    expected = {
        (i, seed): mlx_lm_tokens(model, tokenizer, params, seed)
        for i, params in enumerate(settings)
        for seed in (0, 1)
    }
    with copy_bias(drafter, 40.0):
        mixed = TakingTurns(pair_proposer(drafter), bigram)
        config = EngineConfig(max_batch=4, adaptive=False)
        engine = BatchEngine(model, tokenizer, drafter, config, proposer=mixed)
        try:
            handles = {
                (i, seed): engine.submit(
                    GenerationRequest(PROMPT, settings[i], MAX_TOKENS, seed)
                )
                for i, seed in expected
            }
            engine.start()
            for key, handle in handles.items():
                assert served(handle) == served_as(expected[key], tokenizer), key
        finally:
            engine.stop()
    assert engine.stats.drafts_accepted > 0 and set(mixed.taken) == {0, 1}
