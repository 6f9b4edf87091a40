"""The phrase store: the copies it offers, its file, the policy's kind of round for it,
and losslessness with it."""

import itertools
import shutil

import numpy as np
import pytest
from test_copying import DraftsWithoutTheirBias, copy_bias
from test_greedy import dspark_tokens, target_greedy
from test_policy import NO_PROPOSAL, PLAIN_SECONDS, drafted_seconds
from test_sampling import (
    SEEDS,
    chi_square,
    chi_square_critical,
    exact_joint,
    sample_first_three,
)

from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.decoding.loop import RoundStats
from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.adaptive import AdaptivePolicy
from mlx_dspark.proposers.base import Backlog
from mlx_dspark.proposers.copying import CopyProposer
from mlx_dspark.proposers.suffix_store import (
    PHRASES_FILE,
    SuffixStore,
    read_phrases,
    write_phrases,
)
from mlx_dspark.sampling.processing import SamplingParams


def sample(*args, **kwargs):
    """Residual rejection sampling, whose rows for the store's copied drafts
    these tests check (and catch when wrong)."""
    return sample_first_three(*args, sampling="residual", **kwargs)


def stored(documents) -> SuffixStore:
    store = SuffixStore()
    store.add_documents(documents)
    return store


def offered_copy(documents, tokens, length=2):
    """The copy a :class:`CopyProposer` with a store of ``documents`` offers
    after ``tokens`` (None: none), and whether it is the store's."""
    proposer = CopyProposer(None, 1.0, 100, phrases=stored(documents))
    state = Backlog(None)
    offer = proposer.offer(state, tokens, length)[0]
    if offer.payload is None:
        return None, False
    return offer.payload.tolist(), offer.phrases


def test_the_context_copy_comes_before_the_store():
    assert offered_copy([[1, 2, 3, 9, 9]], [1, 2, 3]) == ([9, 9], True)
    assert offered_copy([[1, 2, 3, 9, 9]], [1, 2, 3, 4, 1, 2, 3]) == ([4, 1], False)
    # Both store documents follow [9, 2, 3] with 8; the context's one
    # occurrence of [2, 3] still comes first. The store needs three tokens.
    documents = [[9, 2, 3, 8], [9, 2, 3, 8]]
    assert offered_copy(documents, [9, 2, 3, 4, 5, 9, 2, 3]) == ([4, 5], False)
    assert offered_copy(documents, [9, 2, 3]) == ([8, -1], True)
    assert offered_copy(documents, [7, 2, 3]) == (None, False)
    assert offered_copy([[1, 2, 3, 9, 9]], [5, 6, 7]) == (None, False)


def test_a_drafter_directory_carries_its_phrase_store(pair_factory, tmp_path):
    model, *_, drafter_dir, _ = pair_factory(block_size=4)
    local = tmp_path / "drafter"
    shutil.copytree(drafter_dir, local)
    assert load_drafter(local, model).phrase_store is None
    write_phrases(local / PHRASES_FILE, [[1, 2, 3], [4, 5]])
    assert sorted(p.name for p in local.iterdir() if "phrases" in p.name) == [
        PHRASES_FILE
    ]
    store = load_drafter(local, model).phrase_store
    assert [d.tolist() for d in store.documents()] == [[1, 2, 3], [4, 5]]
    (local / PHRASES_FILE).write_bytes(b"not an array")
    with pytest.raises(DSparkError, match="cannot be read"):
        load_drafter(local, model)
    np.save(local / PHRASES_FILE, np.array([2, 3, 0, 4], np.uint16))
    with pytest.raises(DSparkError, match="0 after each document"):
        load_drafter(local, model)
    np.save(local / PHRASES_FILE, np.array([2, 3, 0], np.int32))
    with pytest.raises(DSparkError, match="not a 1-D array of token ids"):
        load_drafter(local, model)
    write_phrases(local / PHRASES_FILE, [[1, 99]])
    with pytest.raises(DSparkError, match="beyond the target vocabulary"):
        load_drafter(local, model)


def test_a_store_is_saved_in_16_bits_when_its_ids_fit(tmp_path):
    for documents, dtype in (([[0, 65534], []], np.uint16), ([[65535, 7]], np.uint32)):
        write_phrases(tmp_path / PHRASES_FILE, documents)
        assert np.load(tmp_path / PHRASES_FILE).dtype == dtype
        read = read_phrases(tmp_path / PHRASES_FILE)
        assert [d.tolist() for d in read] == documents
        assert all(d.dtype == np.int32 for d in read)


def play_phrases(policy, rounds, accept):
    """Rounds without a copy, offered the context's and offered the store's
    in turn, as the loop plans them (a store's copy the policy declines is a
    round of the drafter's own guesses); ``accept(n, kind)``. Returns the
    lengths chosen per kind of round offered."""
    chosen = {"text": [], "context": [], "phrases": []}
    for i in range(rounds):
        offered = ("text", "context", "phrases")[i % 3]
        kind = offered
        n = policy.round_cap(7, copy=kind != "text", phrases=kind == "phrases")
        if kind == "phrases" and n == 0:
            kind = "text"
            n = policy.round_cap(7)
        chosen[offered].append((kind, n))
        times = drafted_seconds(n) if n else (0.0, PLAIN_SECONDS)
        stats = RoundStats(
            n, n, accept(n, kind), *times, copy_offered=kind != "text",
            phrases_offered=kind == "phrases",
        )  # fmt: skip
        policy.observe(NO_PROPOSAL, stats)
    return chosen


def test_rounds_offered_the_stores_copy_are_sized_apart():
    """Context copies always kept, the store's never, the drafter's own
    guesses at the first draft: the store's copies give way to the drafter's
    own guesses (probed now and then) without cutting the context's short."""
    accept = {
        "text": lambda n: min(n, 1),
        "context": lambda n: n,
        "phrases": lambda n: 0,
    }
    chosen = play_phrases(AdaptivePolicy(), 600, lambda n, kind: accept[kind](n))
    assert chosen["context"][-50:] == [("context", 7)] * 50
    late = chosen["phrases"][-100:]
    assert sum(kind == "text" and n > 0 for kind, n in late) >= 95
    assert 0 not in [n for _, n in chosen["text"][-50:]]
    # A store that beats plain rounds, not the drafter's own guesses, gives
    # way to them as well.
    half = itertools.cycle([1, 0])
    accept["text"], accept["phrases"] = (
        (lambda n: min(n, 3)),
        (lambda n: min(n, next(half))),
    )
    chosen = play_phrases(AdaptivePolicy(), 600, lambda n, kind: accept[kind](n))
    assert sum(kind == "text" for kind, _ in chosen["phrases"][-100:]) >= 90
    # A store whose copies are kept is drafted from whole instead.
    accept["phrases"], accept["text"] = (lambda n: n), (lambda n: 0)
    chosen = play_phrases(AdaptivePolicy(), 600, lambda n, kind: accept[kind](n))
    assert chosen["phrases"][-50:] == [("phrases", 7)] * 50


def walks(model, starts, length=12):
    """The target's greedy continuations of each start token."""
    return [[s, *target_greedy(model, [s], max_tokens=length)] for s in starts]


def store_offering(model, prompt):
    """A store of the target's walks and of the prompt followed by the
    target's greedy walk from its last token, so that the first round is
    offered the store's copy too."""
    documents = walks(model, range(1, 29), 6)
    walk = documents[prompt[-1] - 1]  # the walk from the prompt's last token
    return stored([*documents, prompt + walk[1:]])


def stranger_pair(pair_factory, **spec):
    """The structured target of ``spec`` with the drafter of another seed's
    pair: its own guesses rarely hold, so the store's copies carry the rounds
    they are offered, and the target's own text holds them often, not always."""
    model, tokenizer, *_ = pair_factory(**spec)
    *_, drafter_dir, _ = pair_factory(**spec, seed=1)
    return model, tokenizer, load_drafter(drafter_dir, model)


@pytest.mark.parametrize("num_draft", [2, 7])
def test_greedy_identical_with_a_phrase_store(pair_factory, num_draft):
    model, tokenizer, drafter = stranger_pair(pair_factory, block_size=8)
    store = stored(walks(model, range(1, 29)))
    prompts = [[13, 5, 21], [20, 4, 11, 9], [7, 8], [1, 2, 3]]
    accepted = {}
    with copy_bias(drafter, 1e3):
        for phrases in (None, store):
            drafter.phrase_store, rounds = phrases, []
            for prompt in prompts:
                expected = target_greedy(model, prompt, max_tokens=32)
                tokens, last = dspark_tokens(
                    model, tokenizer, drafter, prompt, max_tokens=32,
                    num_draft=num_draft, scheduler="off",
                )  # fmt: skip
                assert tokens == expected, (prompt, phrases is None)
                rounds += last.stats.rounds
            label = "none" if phrases is None else "store"
            accepted[label] = np.mean([r.accepted for r in rounds])
            kept = [r.accepted for r in rounds if r.phrases_offered]
            if phrases is None:
                assert not kept
            else:
                assert 0 in kept and num_draft in kept, kept
    assert accepted["store"] > accepted["none"] + 0.5, accepted


def test_sampling_exact_with_a_phrase_store(pair_factory):
    model, _, drafter = stranger_pair(
        pair_factory, markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = SamplingParams(temperature=1.0)
    prompt = [3, 14, 15]
    joint = exact_joint(model, params, prompt)
    drafter.phrase_store = store_offering(model, prompt)
    with copy_bias(drafter, 40.0):
        samples, stats = sample(model, drafter, params, prompt=prompt)
        wrong, _ = sample(
            model, drafter, params, DraftsWithoutTheirBias(), prompt=prompt
        )
    stat, dof = chi_square(samples, joint, SEEDS)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    kept = [r.accepted for r in stats.rounds if r.phrases_offered]
    assert len(kept) > SEEDS // 4 and 0 < np.mean(kept) < 3, (len(kept), np.mean(kept))
    assert chi_square(wrong, joint, SEEDS)[0] > chi_square_critical(dof)
