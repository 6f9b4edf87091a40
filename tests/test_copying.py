"""Context copying: the copies, the drafter's copy bias, and losslessness with it."""

import contextlib
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from conftest import HEADS, head_id
from mlx_dspark.convert.drafter import convert_drafter
from test_convert_drafter import write_speculators
from test_drafter import head_drafter, reduced_drafter, two_blocks
from test_greedy import dspark_tokens, target_greedy
from test_sampling import (
    CONFIGS,
    SEEDS,
    chi_square,
    chi_square_critical,
    exact_joint,
)
from test_sampling import sample_first_three as sample_with

from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.decoding.modes import ChainMode
from mlx_dspark.loading import load
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.policy.policies import MonitoredPolicy
from mlx_dspark.proposers import copying
from mlx_dspark.proposers.base import Proposal
from mlx_dspark.proposers.copying import (
    COPY_CONFIG,
    CopyBias,
    copied_proposal,
    follow_copy,
    pair_proposer,
)
from mlx_dspark.proposers.dspark import DrafterProposer
from mlx_dspark.proposers.suffix_store import context_copy
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter


def sample_first_three(*args, **kwargs):
    """Residual rejection sampling, whose point-mass rows for copied drafts
    these tests check (and catch when wrong); coupled sampling with copies
    is checked against mlx-lm's own draws in test_seed."""
    return sample_with(*args, sampling="residual", **kwargs)


def brute_continuation(history, length, min_ngram=2, max_ngram=3):
    """A context copy's definition, spelled out: what followed the latest
    earlier occurrence of the history's longest suffix of ``min_ngram`` to
    ``max_ngram`` tokens, repeating with its period past the history's end."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-n:]
        for end in range(len(history) - 2, n - 2, -1):
            if history[end - n + 1 : end + 1] == suffix:
                extended = list(history)
                for i in range(length):
                    extended.append(extended[end + 1 + i])
                return extended[len(history) :]
    return [-1] * length


def test_context_copies_match_their_definition_on_random_histories():
    rng = np.random.default_rng(0)
    for trial in range(400):
        history = rng.integers(0, 2 + trial % 6, size=rng.integers(1, 40)).tolist()
        length = int(rng.integers(0, 12))
        expected = brute_continuation(history, length)
        assert context_copy(history, length, COPY_CONFIG).tolist() == expected


def test_copies_are_the_suffix_store_s_chains_of_two_or_more_matched_tokens():
    # [1, 6, 7] occurred once, then 8, 2, 6, 7, 9, 1, 6, 7 up to the end;
    # past the end the copy repeats with its period.
    context = [1, 6, 7, 8, 2, 6, 7, 9, 1, 6, 7]
    assert context_copy(context, 4, COPY_CONFIG).tolist() == [8, 2, 6, 7]
    assert context_copy(context, 10, COPY_CONFIG).tolist() == [
        8, 2, 6, 7, 9, 1, 6, 7, 8, 2,
    ]  # fmt: skip
    # [6, 7] last occurred before 9 (the latest occurrence, not the commonest).
    context = [1, 6, 7, 8, 2, 6, 7, 9, 3, 6, 7]
    assert context_copy(context, 4, COPY_CONFIG).tolist() == [9, 3, 6, 7]
    assert context_copy([5, 5, 5], 3, COPY_CONFIG).tolist() == [5, 5, 5]
    # One token seen before is not enough.
    assert context_copy([1, 2, 3, 2], 2, COPY_CONFIG).tolist() == [-1, -1]
    assert context_copy([4], 2, COPY_CONFIG).tolist() == [-1, -1]
    assert context_copy([4, 4], 0, COPY_CONFIG).tolist() == []


def toward(copy, bias):
    """The copy bias of ``bias`` toward ``copy``."""
    return CopyBias(copy, mx.array(bias, mx.float32))


def with_copy_bias(drafter, bias):
    drafter.config = dataclasses.replace(drafter.config, context_copy_bias=bias)
    return drafter


@contextlib.contextmanager
def copy_bias(drafter, bias):
    """The (session-cached) drafter copying with ``bias`` inside the block."""
    original = drafter.config
    with_copy_bias(drafter, bias)
    try:
        yield drafter
    finally:
        drafter.config = original


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced"])
@pytest.mark.parametrize("head", ["vanilla", "rnn", None])
@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_copy_bias_lifts_the_copied_tokens_while_the_drafts_follow_them(
    head, reduced, temperature
):
    drafter = head_drafter(head, reduced, 2)
    ids = drafter.draft_to_target.tolist() if reduced else list(range(31))
    hidden, anchor = two_blocks(drafter)
    params = SamplingParams(temperature=temperature)
    key = None if params.greedy else mx.random.key(1)
    copy = mx.array([[ids[5], ids[7], -1, ids[2]], [ids[9], ids[4], ids[1], ids[6]]])
    # A pair whose drafter's config has no copy bias does not copy.
    assert isinstance(pair_proposer(drafter), DrafterProposer)
    copied = drafter.propose(hidden, anchor, 4, params, key, bias=toward(copy, 1e4))
    # Row 0 follows the copy until it runs out; after its own draft the copy
    # at position 3 no longer applies. Row 1 follows it all the way.
    tokens = copied.tokens.tolist()
    assert tokens[0][:2] == copy[0, :2].tolist()
    assert tokens[1] == copy[1].tolist()
    # Sampled rows are the processed weights: at T=0.5 the logits times 2.
    rows = np.array(copied.logits, dtype=np.float64) * (temperature or 1.0)
    assert rows[0, 3, copy[0, 3].item()] < 1e3
    # The rows the drafts were drawn from carry the bias, so the verifier sees
    # the true proposal; the calibration reads which rows did and the
    # drafter's own log-probability (without the bias) of each row's top.
    assert rows[1, 0, copy[1, 0].item()] > 1e3
    flags = [[True, True, False, False], [True, True, True, True]]
    assert copied.copied.tolist() == flags
    own = rows.copy()
    for r, k in zip(*np.nonzero(flags), strict=True):
        own[r, k, copy[r, k].item()] -= 1e4
    top = rows.argmax(-1)
    finite = np.where(np.isfinite(own), own, -np.inf)
    shift = finite.max(-1, keepdims=True)
    log_z = np.log(np.exp(finite - shift).sum(-1)) + shift[..., 0]
    expected = np.take_along_axis(own, top[..., None], -1)[..., 0] - log_z
    assert np.allclose(np.array(copied.top_logprob), expected, atol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_copied_tokens_outside_a_reduced_vocabulary_are_drafted_from_a_point_mass(
    temperature,
):
    drafter = reduced_drafter("vanilla", 3)
    ids = drafter.draft_to_target.tolist()
    first, second = [t for t in range(31) if t not in set(ids)][:2]
    anchor = mx.array([3])
    hidden = drafter(drafter.block_tokens(anchor), 0, None, drafter.make_cache())
    params = SamplingParams(temperature=temperature)
    key = None if params.greedy else mx.random.key(1)
    copy = mx.array([[first, ids[4], second]])
    copied = drafter.propose(hidden, anchor, 3, params, key, bias=toward(copy, 1e4))
    assert copied.tokens.tolist() == copy.tolist()
    rows = np.array(copied.logits[0], dtype=np.float64)
    for k in (0, 2):  # outside: all the mass on the copied token
        token = copy[0, k].item()
        assert rows[k, token] == 0 and np.isneginf(np.delete(rows[k], token)).all()
    assert rows[1, ids[4]] > 1e3  # inside: the copy bias, as before
    assert copied.copied.tolist() == [[True, True, True]]
    # The forced rows' top log-probability: the lowest of the drafter's own row.
    own = np.array(drafter.logits(hidden[:, :3])[0], dtype=np.float64)
    head = drafter.markov_head
    prev = mx.array([[3, first, ids[4]]])
    own += np.array(head.block_bias(prev, hidden[:, :3])[0], dtype=np.float64)
    own_logprob = own - np.log(np.exp(own).sum(-1, keepdims=True))
    tops = np.array(copied.top_logprob[0])
    assert np.allclose(tops[[0, 2]], own_logprob[[0, 2]].min(-1), atol=1e-4)

    # Drafts that left the copy are not forced back onto it.
    plain = drafter.propose(hidden, anchor, 3, params, key)
    other = next(t for t in ids if t != plain.tokens[0, 0].item())
    left = drafter.propose(
        hidden, anchor, 3, params, key,
        bias=toward(mx.array([[other, first, second]]), 1e-6),
    )  # fmt: skip
    assert left.tokens.tolist() == plain.tokens.tolist()
    assert left.copied.tolist() == [[True, False, False]]


REPEATING_PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [7, 8, 7, 8, 7], [20, 4, 11, 9, 20, 4]]


@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_greedy_identical_with_context_copying(pair_factory, head):
    model, tokenizer, drafter, *_ = pair_factory(markov_head_type=head, block_size=8)
    accepted = {}
    try:
        for bias in (0.0, 1e3):
            with_copy_bias(drafter, bias)
            rounds = []
            for prompt in REPEATING_PROMPTS:
                expected = target_greedy(model, prompt)
                for num_draft in (1, 3, 8):
                    tokens, last = dspark_tokens(
                        model, tokenizer, drafter, prompt, max_tokens=64,
                        num_draft=num_draft, scheduler="off",
                    )  # fmt: skip
                    assert tokens == expected, (prompt, num_draft, bias)
                    rounds += last.stats.rounds
            accepted[bias] = np.mean([r.accepted for r in rounds])
    finally:
        with_copy_bias(drafter, 0.0)
    # The structured target repeats itself; copying must be accepted more.
    assert accepted[1e3] > accepted[0.0] + 0.2, accepted


# "0 x" occurred for every token x but 0 and the mask, so whatever comes
# first, the context has a copy to offer: "0, x + 1, 0, ...".
COPY_PROMPT = [*(t for x in range(1, 31) for t in (0, x)), 0]


class DraftsWithoutTheirBias(ChainMode):
    """A wrong proposal: drafts drawn with the copy bias, verified against
    rows without it."""

    def propose(self, proposer, state, round):
        proposal = super().propose(proposer, state, round)
        again = dataclasses.replace(round, features=None)  # already ingested
        unbiased = proposer.inner.propose(state.inner, again)
        proposal.logits = unbiased.logits
        return proposal


@pytest.mark.parametrize("params", CONFIGS, ids=["t0.7-p0.9-k8", "t1"])
def test_sampling_exact_with_context_copying(pair_factory, params):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    joint = exact_joint(model, params, COPY_PROMPT)
    try:
        with_copy_bias(drafter, 40.0)
        samples, stats = sample_first_three(model, drafter, params, prompt=COPY_PROMPT)
        stat, dof = chi_square(samples, joint, SEEDS)
        assert dof >= 5
        assert stat < chi_square_critical(dof), (stat, dof)
        accepted = [r.accepted for r in stats.rounds]
        assert 0 < np.mean(accepted) < max(r.verified for r in stats.rounds)
        if params.temperature == 1.0:
            wrong, _ = sample_first_three(
                model, drafter, params, DraftsWithoutTheirBias(), prompt=COPY_PROMPT
            )
            assert chi_square(wrong, joint, SEEDS)[0] > chi_square_critical(dof)
    finally:
        with_copy_bias(drafter, 0.0)


# Odd tokens from 3 on are left out of the reduced draft vocabulary, and
# "0, x" was followed by one of them for every x but 0, 30 (end of sequence)
# and the mask: whatever the target samples first, the first round is offered
# a copy whose first token no row can hold.
LEFT_OUT = tuple(range(3, 31, 2))
OUTSIDE_PROMPT = [*(t for x in range(1, 30) for t in (0, x, 3 + 2 * (x % 13))), 0]


@pytest.fixture(scope="module")
def reduced_pair(tmp_path_factory):
    """The structured pair of the copying tests, its drafter converted to a
    reduced draft vocabulary without ``LEFT_OUT``."""
    root = tmp_path_factory.mktemp("reduced_pair")
    target_dir, drafter_dir = build_structured_pair(
        root / "pair", PairSpec(sharpness=0.6, block_size=4)
    )
    model, tokenizer, _ = load(target_dir)
    keep = [t for t in range(model.args.vocab_size) if t not in LEFT_OUT]
    write_speculators(drafter_dir, root / "spec", keep)
    convert_drafter(root / "spec", root / "reduced", target=target_dir)
    return model, tokenizer, load_drafter(root / "reduced", model)


class CountsDraftsOutside(ChainMode):
    """Counts the drafts outside the draft vocabulary; with ``wrong``, a
    wrong proposal: those drafts verified against uniform rows."""

    def __init__(self, wrong=False):
        self.wrong, self.outside = wrong, 0

    def propose(self, proposer, state, round):
        proposal = super().propose(proposer, state, round)
        outside = mx.array(np.isin(np.array(proposal.tokens), LEFT_OUT))
        self.outside += int(outside.sum().item())
        if self.wrong:
            rows = proposal.logits
            proposal.logits = mx.where(outside[..., None], mx.zeros_like(rows), rows)
        return proposal


@pytest.mark.parametrize("params", CONFIGS, ids=["t0.7-p0.9-k8", "t1"])
def test_sampling_exact_with_copies_outside_a_reduced_vocabulary(reduced_pair, params):
    model, _, drafter = reduced_pair
    joint = exact_joint(model, params, OUTSIDE_PROMPT)
    with copy_bias(drafter, 40.0):
        mode = CountsDraftsOutside()
        samples, stats = sample_first_three(
            model, drafter, params, mode, prompt=OUTSIDE_PROMPT
        )
        stat, dof = chi_square(samples, joint, SEEDS)
        assert dof >= 5
        assert stat < chi_square_critical(dof), (stat, dof)
        assert mode.outside > SEEDS // 10
        if params.temperature == 1.0:
            wrong, _ = sample_first_three(
                model, drafter, params, CountsDraftsOutside(wrong=True),
                prompt=OUTSIDE_PROMPT,
            )  # fmt: skip
            assert chi_square(wrong, joint, SEEDS)[0] > chi_square_critical(dof)


def test_greedy_identical_with_copies_outside_a_reduced_vocabulary(reduced_pair):
    model, tokenizer, drafter = reduced_pair
    with copy_bias(drafter, 40.0):
        for prompt in [COPY_PROMPT, *REPEATING_PROMPTS]:
            expected = target_greedy(model, prompt)
            for num_draft in (1, 4):
                tokens, _ = dspark_tokens(
                    model, tokenizer, drafter, prompt, max_tokens=64,
                    num_draft=num_draft, scheduler="off",
                )  # fmt: skip
                assert tokens == expected, (prompt, num_draft)


def test_follow_copy_goes_on_with_the_copy_only_where_the_drafts_followed_it():
    drafts = Proposal(mx.array([[5, 7]]), mx.zeros((1, 2, 12)))
    longer = follow_copy(drafts, mx.array([[5, 7, 9, 4]]))
    assert longer.tokens.tolist() == [[5, 7, 9, 4]]
    rows = np.array(longer.logits[0])
    assert (rows[:2] == 0).all()
    for row, token in zip(rows[2:], (9, 4), strict=True):
        assert row[token] == 0 and np.isneginf(np.delete(row, token)).all()
    for copy in ([[5, 8, 9, 4]], [[6, 7, 9, 4]], [[5, 7]]):
        assert follow_copy(drafts, mx.array(copy)) is drafts


class OneDraft(DrafterProposer):
    """A drafter block of one draft: a round offered a copy goes on past it
    with the copy's own tokens."""

    def propose(self, state, round, bias=None):
        return super().propose(state, dataclasses.replace(round, cap=1), bias)


def one_draft_then_the_copy(drafter, copy_draft):
    return dataclasses.replace(
        pair_proposer(drafter, copy_draft), inner=OneDraft(drafter)
    )


class CopiesAgainstWrongRows(ChainMode):
    """A wrong proposal: the copied drafts verified against uniform rows."""

    def propose(self, proposer, state, round):
        proposal = super().propose(proposer, state, round)
        rows = proposal.logits
        proposal.logits = mx.concatenate([rows[:, :1], mx.zeros_like(rows[:, 1:])], 1)
        return proposal


def repeated_walk(model, length=10):
    """The target's greedy walk from token 3, then its first two tokens again:
    the context offers the rest of the walk as a copy, which the target
    (sampled) often follows."""
    walk = [3]
    while len(walk) < length:
        walk.append(int(mx.argmax(model(mx.array([walk]))[0, -1]).item()))
    return walk + walk[:2]


@pytest.mark.parametrize("params", CONFIGS, ids=["t0.7-p0.9-k8", "t1"])
def test_sampling_exact_with_copies_past_the_block(pair_factory, params):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    prompt = repeated_walk(model)
    joint = exact_joint(model, params, prompt)
    loop = {"max_tokens": 6, "num_draft": 1, "prompt": prompt}
    whole = MonitoredPolicy  # verifies every draft proposed
    with copy_bias(drafter, 40.0):
        loop["proposer"] = one_draft_then_the_copy(drafter, 4)
        samples, stats = sample_first_three(
            model, drafter, params, policy=whole, **loop
        )
        stat, dof = chi_square(samples, joint, SEEDS)
        assert dof >= 5
        assert stat < chi_square_critical(dof), (stat, dof)
        past = [r.accepted for r in stats.rounds if r.verified > 1]
        assert len(past) > SEEDS // 4 and 0 < np.mean(past) and max(past) > 1
        if params.temperature == 1.0:
            wrong, _ = sample_first_three(
                model, drafter, params, CopiesAgainstWrongRows(), policy=whole, **loop
            )
            assert chi_square(wrong, joint, SEEDS)[0] > chi_square_critical(dof)


class CountingDrafter:
    """A drafter that counts its backbone passes."""

    def __init__(self, inner):
        self.inner, self.passes = inner, 0

    def __call__(self, *args, **kwargs):
        self.passes += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("copy_draft", [4, 8])
def test_copies_as_is_are_lossless_and_skip_the_drafter(pair_factory, copy_draft):
    model, _, drafter, *_ = pair_factory(block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    kept = []
    with copy_bias(drafter, 1e3):
        for prompt in [*REPEATING_PROMPTS, [13, 5, 5, 21, 2, 17], COPY_PROMPT]:
            counting, stats = CountingDrafter(drafter), GenerationStats()
            proposer = pair_proposer(counting, copy_draft, copy_as_is=True)
            steps = speculative_generate_step(
                mx.array(prompt), target, proposer, num_draft=4, max_tokens=48,
                policy=MonitoredPolicy(), stats=stats,
            )  # fmt: skip
            tokens = [t for t, _ in steps]
            assert tokens == target_greedy(model, prompt, max_tokens=48)
            drafted = [r for r in stats.rounds if r.drafted]
            # Only rounds whose copy does not cover all their drafts run the
            # drafter.
            done, uncovered = 1, 0
            for r in stats.rounds:
                history = [*prompt, *tokens[:done]]
                copy = context_copy(history, r.verified, COPY_CONFIG)
                uncovered += r.drafted and not (r.copy_offered and (copy >= 0).all())
                done += r.accepted + 1
            assert counting.passes == uncovered
            kept += [r.accepted / r.verified for r in drafted if r.copy_offered]
    assert min(kept) < 1 and max(kept) == 1, kept


@pytest.mark.parametrize("params", CONFIGS, ids=["t0.7-p0.9-k8", "t1"])
def test_sampling_exact_with_copies_as_is(pair_factory, params, monkeypatch):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    prompt = repeated_walk(model)
    joint = exact_joint(model, params, prompt)
    loop = {"max_tokens": 6, "copy_draft": 6, "copy_as_is": True, "prompt": prompt}
    with copy_bias(drafter, 40.0):
        samples, stats = sample_first_three(
            model, drafter, params, policy=MonitoredPolicy, **loop
        )
        stat, dof = chi_square(samples, joint, SEEDS)
        assert dof >= 5
        assert stat < chi_square_critical(dof), (stat, dof)
        copied = [r.accepted for r in stats.rounds if r.drafted and r.copy_offered]
        assert len(copied) > SEEDS // 4 and 0 < np.mean(copied) < 5, copied
        if params.temperature == 1.0:

            def against_uniform_rows(copy, vocab_size):
                proposal = copied_proposal(copy, vocab_size)
                return Proposal(proposal.tokens, mx.zeros_like(proposal.logits))

            monkeypatch.setattr(copying, "copied_proposal", against_uniform_rows)
            wrong, _ = sample_first_three(
                model, drafter, params, policy=MonitoredPolicy, **loop
            )
            assert chi_square(wrong, joint, SEEDS)[0] > chi_square_critical(dof)
