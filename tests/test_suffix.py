"""Suffix drafts with no drafter (:mod:`mlx_dspark.proposers.suffix`), chains
and trees: greedy output is mlx-lm's on full-attention, sliding-window and
recurrent targets, float and 4-bit, with drafts accepted and rejected;
sampled output is an exact sample; seeded output is ``mlx_lm --seed``'s; the
command line's ``--dspark-suffix``."""

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from test_cli import run
from test_families import plain_greedy
from test_sampling import chi_square, chi_square_critical, exact_joint
from test_seed import MAX_TOKENS as SEED_TOKENS
from test_seed import PROMPT as SEED_PROMPT
from test_seed import SEEDS, SETTINGS, kwargs, mlx_lm_tokens
from tiny_families import VOCAB, WINDOW

from mlx_dspark import stream_generate
from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.decoding.modes import ChainMode, TreeMode
from mlx_dspark.errors import DSparkError
from mlx_dspark.generation import suffix_stats
from mlx_dspark.proposers.base import Offer, Round
from mlx_dspark.proposers.suffix import SuffixProposer, chain_of, tree_proposal
from mlx_dspark.proposers.suffix_store import SuffixDraft, SuffixStore
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter

PROMPT = [5, 7, 1, 2, 9, 3, 4, 0, 2, 11, 6]
MAX_TOKENS = 5 * WINDOW  # test_families' plain_greedy default
BITS = [None, 4]
# A full-attention family (trees too), a sliding-window one, a hybrid
# recurrent one.
FAMILIES = ["qwen3", "gemma3_text", "qwen3_5"]


def suffix_loop(model, prompt, mode=None, stats=None, **loop):
    """The loop with suffix drafts and its default policy (every draft
    verified), as ``(token, from_draft)`` pairs."""
    target = TargetAdapter(model)
    tree = isinstance(mode, TreeMode)
    proposer = SuffixProposer(target.vocab_size, tree=tree)
    loop = {"num_draft": 16, "max_tokens": MAX_TOKENS, **loop}
    tokens = speculative_generate_step(
        mx.array(prompt), target, proposer, mode=mode, stats=stats, **loop
    )
    return list(tokens)


def until_eos(tokens, tokenizer):
    """The tokens ``stream_generate`` yields: up to the first end of sequence,
    which its last response carries."""
    eos = tokenizer.eos_token_ids
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


# -- the proposer ----------------------------------------------------------


def test_offers_index_only_what_is_new_and_propose_the_draft():
    proposer = SuffixProposer(VOCAB)
    state = proposer.make_state()
    history = [1, 2, 3, 4, 1, 2]
    offers = proposer.offer(state, history, 8)
    assert state.request.index.tokens.tolist() == history and state.seen == 6
    [offer] = offers
    assert offer.copy and offer.longest == 2  # a match of 2 allows 2 tokens
    assert offer.payload.tokens.tolist() == [3, 4]
    history += [3, 4]
    offers = proposer.offer(state, history, 8)
    assert state.request.index.tokens.tolist() == history
    round = Round(history, None, 3, SamplingParams(), None, offers[0])
    proposal = proposer.propose(state, round)
    assert proposal.tokens.tolist() == [[1, 2, 3]]
    rows = np.array(proposal.logits[0])
    assert (np.argmax(rows, axis=-1) == [1, 2, 3]).all()
    assert np.isinf(rows).sum() == 3 * (VOCAB - 1)  # point masses
    # Nothing to draft: a plain round (an offer whose cap is 0).
    fresh = proposer.make_state()
    assert proposer.offer(fresh, [5, 6, 7], 8) == [Offer(0)]


def test_explicit_trees_keep_shallow_nodes_and_renumber_parents():
    draft = SuffixDraft(
        np.array([7, 8, 9, 10, 11], np.int32),
        np.array([-1, -1, 0, 2, 1], np.int32),
        np.array([0.6, 0.4, 0.5, 0.4, 0.3], np.float32),
    )
    proposal = tree_proposal(draft, 2, VOCAB)
    assert proposal.tokens.tolist() == [[7, 8, 9, 11]]
    assert proposal.extra == {"parents": [0, 0, 1, 2], "explicit": True}
    assert chain_of(draft).tolist() == [7, 9, 10]


def test_a_global_store_drafts_from_another_requests_output():
    store = SuffixStore()
    writer = SuffixProposer(VOCAB, store=store)
    state = writer.make_state()
    writer.offer(state, [1, 2, 3], 8)  # the prompt [1, 2], then the output
    writer.offer(state, [1, 2, 3, 4, 5, 6, 7, 8], 8)
    writer.close(state)
    reader = SuffixProposer(VOCAB, store=store)
    [offer] = reader.offer(reader.make_state(), [9, 9, 4, 5, 6], 8)
    assert offer.copy and offer.payload.source == "global"
    assert offer.payload.tokens.tolist()[:2] == [7, 8]


# -- greedy: mlx-lm's output, chain and tree --------------------------------


@pytest.mark.parametrize("bits", BITS, ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_identical_to_mlx_lm(family, model_type, bits):
    """Every draft verified, and the adaptive policy as ``stream_generate``
    runs it; sliding windows and recurrent states roll back past rejected
    drafts."""
    model, tokenizer, _ = family(model_type, bits)
    stats = GenerationStats()
    for prompt in (PROMPT, PROMPT[4:]):
        expected = plain_greedy(model, prompt)
        got = suffix_loop(model, prompt, stats=stats)
        assert [t for t, _ in got] == expected, prompt
        responses = list(
            stream_generate(
                model, tokenizer, None, prompt, max_tokens=MAX_TOKENS, suffix=True
            )
        )
        assert [r.token for r in responses] == until_eos(expected, tokenizer)
        stats.rounds += responses[-1].stats.rounds
    drafted = [r for r in stats.rounds if r.drafted]
    assert all(r.copy_offered for r in drafted)
    assert any(r.accepted > 0 for r in drafted)
    assert any(r.accepted < r.verified for r in drafted)


# Prompts in which the token 7 was followed by another token three times and
# by 29 once: trees after 7 branch, and where the target goes on with the
# rarer continuation, the kept path leaves the tree's first branch.
BRANCHING = [[7, w] * 3 + [7, 29, 4, 7] for w in range(0, VOCAB, 3)]


@pytest.mark.parametrize("bits", BITS, ids=["float", "q4"])
def test_tree_greedy_identical_to_mlx_lm(family, bits):
    model, tokenizer, _ = family("qwen3", bits)
    rounds = []
    for prompt in BRANCHING:
        mode = TreeMode(8)
        got = suffix_loop(model, prompt, mode=mode, max_tokens=24)
        assert [t for t, _ in got] == plain_greedy(model, prompt, 24), prompt
        rounds += mode.rounds
    for prompt in (PROMPT, PROMPT[4:], [3, 3, 8]):
        expected = plain_greedy(model, prompt)
        for budget in (4, 8):
            mode = TreeMode(budget)
            got = suffix_loop(model, prompt, mode=mode)
            assert [t for t, _ in got] == expected, (prompt, budget)
            rounds += mode.rounds
        responses = list(
            stream_generate(
                model,
                tokenizer,
                None,
                prompt,
                max_tokens=MAX_TOKENS,
                suffix=True,
                tree_budget=6,
            )
        )
        assert [r.token for r in responses] == until_eos(expected, tokenizer)
    assert any(r.nodes > r.depth for r in rounds)  # some trees branch
    assert any(r.path != list(range(len(r.path))) for r in rounds)  # off the first
    assert any(r.accepted > 0 for r in rounds)
    assert any(r.accepted < r.depth for r in rounds)


def test_trees_on_sliding_window_targets_are_refused_in_one_sentence(family):
    model, tokenizer, _ = family("gemma3_text")
    with pytest.raises(DSparkError, match="use chain drafting") as caught:
        list(
            stream_generate(model, tokenizer, None, PROMPT, suffix=True, tree_budget=4)
        )
    assert "\n" not in str(caught.value)


# -- sampled: exact samples --------------------------------------------------


def sample_first_three(model, prompt, params, make_mode, seeds):
    """The first three tokens of ``seeds`` runs (residual rejection sampling)."""
    samples, stats, modes = Counter(), GenerationStats(), []
    for seed in range(seeds):
        modes.append(make_mode())
        tokens = suffix_loop(
            model,
            prompt,
            mode=modes[-1],
            stats=stats,
            params=params,
            seed=seed,
            max_tokens=3,
            sampling="residual",
        )
        samples[tuple(t for t, _ in itertools.islice(tokens, 3))] += 1
    return samples, stats, modes


def repetitive_prompt(model) -> list[int]:
    """A prompt ending in the target's own greedy cycle, so that suffix drafts
    are there from the first round and often right at a warm temperature."""
    start = [5, 7, 1]
    return start + plain_greedy(model, start, 14)


def branching_prompt(model) -> list[int]:
    """A prompt in which ``y t`` was followed by the target's own next token
    and by another one, for half the tokens ``t``, and that ends with ``y``:
    when the first token is one of them, the first round's tree branches."""
    y, prompt = 0, []
    for t in range(1, VOCAB // 2):
        own = int(mx.argmax(model(mx.array([[y, t]]))[0, -1]).item())
        prompt += [y, t, own, y, t, (own + 1) % VOCAB]
    return prompt + [y]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_is_exact(family, tree):
    model, _, _ = family("qwen3")
    prompt = branching_prompt(model) if tree else repetitive_prompt(model)
    params = SamplingParams(temperature=2.0)
    joint = exact_joint(model, params, prompt)
    seeds = 1500

    def make_mode():
        return TreeMode(6) if tree else ChainMode()

    samples, stats, modes = sample_first_three(model, prompt, params, make_mode, seeds)
    stat, dof = chi_square(samples, joint, seeds)
    assert dof >= 10
    assert stat < chi_square_critical(dof), (stat, dof)
    drafted = [r for r in stats.rounds if r.drafted]
    assert any(r.accepted > 0 for r in drafted)
    assert any(r.accepted < r.verified for r in drafted)
    if tree:
        trees = [r for m in modes for r in m.rounds if r.nodes]
        assert any(r.nodes > r.depth for r in trees)


def walk_outcomes(own_rows: bool, draws: int = 8000) -> tuple[Counter, dict]:
    """The first two committed tokens of a tree round whose root has point-mass
    children 1, 2, 3 and whose node 1 has children 4, 5, verified against
    fixed target rows; and their exact law."""
    rng = np.random.default_rng(0)
    V = 6
    p = rng.dirichlet(np.ones(V), size=6)  # rows: anchor, then node 1..5
    logits = mx.array(np.log(p), mx.float32)
    tokens = [0, 1, 2, 3, 4, 5]
    children = [[1, 2, 3], [4, 5], [], [], [], []]
    keep = [0, 1, 2, 3, 4, 5]
    rows = mx.where(mx.arange(V) == mx.array(tokens[1:])[:, None], 0.0, -mx.inf)
    mode, params = TreeMode(5), SamplingParams(temperature=1.0)
    seen = Counter()
    for _ in range(draws):
        path, bonus = mode._walk_sampled(
            logits, rows, keep, tokens, children, params, rng, own_rows
        )
        committed = [tokens[i] for i in path[1:]] + [bonus]
        seen[tuple(committed[:2]) if len(committed) > 1 else (committed[0],)] += 1
    law = {}
    for a in range(V):
        if a in (1, 2, 3):  # node a is in the tree: its row gives the next one
            for b in range(V):
                law[(a, b)] = p[0, a] * p[a, b]
        else:
            law[(a,)] = p[0, a]
    return seen, law


def test_point_mass_siblings_are_tried_against_their_own_rows():
    """Rejecting a point-mass child leaves the target's distribution without
    it; the drawn-tree rule (one shared row, renormalised without the
    rejected tokens) would accept the next sibling whatever the target says,
    and the test catches that."""
    seen, law = walk_outcomes(own_rows=True)
    stat, dof = chi_square(seen, law, 8000)
    assert dof >= 10
    assert stat < chi_square_critical(dof), (stat, dof)
    seen, law = walk_outcomes(own_rows=False)
    stat, dof = chi_square(seen, law, 8000)
    assert stat > chi_square_critical(dof)


# -- seeded: mlx-lm's own tokens ---------------------------------------------


@pytest.fixture(scope="module")
def pair(pair_factory):
    return pair_factory(markov_head_type="vanilla", sharpness=0.6, block_size=5)


@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chain", "tree"])
@pytest.mark.parametrize("name", ["t1", "t0.7-p0.9"])
def test_seeded_output_equals_mlx_lm(pair, name, tree_budget):
    model, tokenizer, *_ = pair
    params = SETTINGS[name]
    accepted = rejected = 0
    for seed in SEEDS:
        responses = list(
            stream_generate(
                model,
                tokenizer,
                None,
                mx.array(SEED_PROMPT),
                max_tokens=SEED_TOKENS,
                seed=seed,
                suffix=True,
                tree_budget=tree_budget,
                num_draft=4,
                **kwargs(params),
            )
        )
        expected = mlx_lm_tokens(model, tokenizer, params, seed)
        assert [r.token for r in responses] == expected, seed
        drafted = [r for r in responses[-1].stats.rounds if r.drafted]
        accepted += sum(r.accepted for r in drafted)
        rejected += sum(r.accepted < r.verified for r in drafted)
    assert accepted > 0 and rejected > 0


# -- the Python API's and the command line's words ---------------------------


def test_suffix_trees_with_a_drafter_or_a_confidence_scheduler_are_one_sentence(
    pair,
):
    model, tokenizer, drafter, *_ = pair
    with pytest.raises(DSparkError, match="chains only"):
        list(
            stream_generate(
                model, tokenizer, drafter, [1, 2], suffix=True, tree_budget=4
            )
        )
    for scheduler in ("auto", "threshold"):
        with pytest.raises(DSparkError, match="no confidences") as caught:
            list(
                stream_generate(
                    model, tokenizer, None, [1, 2], suffix=True, scheduler=scheduler
                )
            )
        assert "\n" not in str(caught.value)


def test_suffix_stats_count_the_suffix_rounds(family):
    model, tokenizer, _ = family("qwen3")
    responses = list(
        stream_generate(model, tokenizer, None, PROMPT, max_tokens=30, suffix=True)
    )
    rounds = responses[-1].stats.rounds
    drafted = [r for r in rounds if r.drafted]
    line = suffix_stats(responses[-1].stats)
    assert line.startswith(f"Suffix drafts: {len(drafted)} of {len(rounds)} rounds")
    accepted = sum(r.accepted for r in drafted)
    assert f"{accepted} of {sum(r.verified for r in drafted)} drafted" in line


def test_cli_dspark_suffix(family):
    _, _, path = family("qwen3")
    common = ["--model", str(path), "-p", "t5 t7 t1 t2 t9 t3", "-m", "40"]
    common += ["--ignore-chat-template"]
    plain = run(*common, "--verbose", "false")  # mlx-lm's own generate
    chain = run(*common, "--dspark-suffix", "--verbose", "false")
    tree = run(*common, "--dspark-suffix", "--dspark-tree", "6", "--verbose", "false")
    assert plain.returncode == chain.returncode == tree.returncode == 0, chain.stderr
    assert chain.stdout == plain.stdout and tree.stdout == plain.stdout
    verbose = run(*common, "--dspark-suffix")
    assert verbose.returncode == 0, verbose.stderr
    assert "Suffix drafts: " in verbose.stdout and "Policy: adaptive" in verbose.stdout
    for extra, message in (
        (["--dspark-scheduler", "auto"], "no confidences to schedule by"),
        (["--dspark-n-draft", "40"], "--dspark-n-draft must be between 0 and"),
        (["--draft-model", str(path)], "drop the mlx-lm --draft-model"),
    ):
        bad = run(*common, "--dspark-suffix", *extra)
        assert bad.returncode == 1, extra
        assert message in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


# -- learning across generations and runs (the global store) ---------------


def fresh_tokenizer(path):
    """A tokenizer object of its own: its process store starts empty."""
    return mlx_lm_load(str(path))[1]


def global_rounds(stats) -> list:
    return [r for r in stats.rounds if r.drafted and r.source == "global"]


def test_a_second_generation_drafts_from_the_first_through_the_process_store(
    family,
):
    model, _, path = family("qwen3")
    tokenizer = fresh_tokenizer(path)
    expected = until_eos(plain_greedy(model, PROMPT, 40), tokenizer)

    def run(**kw):
        responses = list(
            stream_generate(
                model, tokenizer, None, PROMPT, max_tokens=40, suffix=True, **kw
            )
        )
        assert [r.token for r in responses] == expected
        return responses[-1].stats

    first = run()
    assert not global_rounds(first)  # nothing earlier to draft from
    second = run()  # the default: the store kept on the tokenizer object
    shared = global_rounds(second)
    assert shared and sum(r.accepted for r in shared) > 0
    assert "rounds drafted from earlier text" in suffix_stats(second)
    kept = tokenizer.dspark_suffix_stores["process"].store
    assert kept.num_documents == 2
    assert kept.documents()[0].tolist() == [
        t for t in expected if t not in (tokenizer.eos_token_ids)
    ]
    alone = run(suffix_store="none")
    assert not global_rounds(alone)
    assert kept.num_documents == 2  # "none" writes nothing


def test_a_generation_stopped_early_closes_its_document(family):
    model, _, path = family("qwen3")
    tokenizer = fresh_tokenizer(path)
    store = SuffixStore()
    responses = stream_generate(
        model, tokenizer, None, PROMPT, max_tokens=40, suffix=True, suffix_store=store
    )
    taken = [next(responses).token for _ in range(6)]
    responses.close()
    assert not store._live  # closed, not left being written
    [document] = store.documents()
    assert document.tolist()[:6] == taken
    assert not hasattr(tokenizer, "dspark_suffix_stores")  # a store was given


def test_store_files_round_trip_across_runs(family, tmp_path):
    """Two processes: the second drafts from what the first wrote, read from
    the user cache (auto, keyed by the tokenizer) or a given file."""
    from mlx_dspark.proposers.suffix_files import tokenizer_fingerprint

    model, tokenizer, path = family("qwen3")
    common = ["--model", str(path), "-p", "t5 t7 t1 t2 t9 t3", "-m", "40"]
    common += ["--ignore-chat-template"]
    plain = run(*common, "--verbose", "false")
    cache = tmp_path / "cache"
    env = {"MLX_DSPARK_CACHE": str(cache)}
    auto = cache / "suffix" / f"{tokenizer_fingerprint(tokenizer)}.npz"
    given = tmp_path / "mine" / "store.npz"
    for where, file in (([], auto), (["--dspark-suffix-store", str(given)], given)):
        first = run(*common, "--dspark-suffix", *where, env=env)
        assert first.returncode == 0, first.stderr
        assert "from earlier text" not in first.stdout
        assert file.exists()
        second = run(*common, "--dspark-suffix", *where, env=env)
        assert second.returncode == 0, second.stderr
        line = next(x for x in second.stdout.splitlines() if "Suffix drafts" in x)
        assert "rounds drafted from earlier text" in line, line
        assert int(line.split("earlier text (the suffix store), ")[1].split()[0]) > 0
        quiet = run(*common, "--dspark-suffix", *where, "--verbose", "false", env=env)
        assert quiet.stdout == plain.stdout
    none = run(*common, "--dspark-suffix", "--dspark-suffix-store", "none", env=env)
    assert "from earlier text" not in none.stdout


def bad_store(file, kind: str) -> None:
    store = SuffixStore()
    store.add_document([1, 2, 3, 4])
    store.save(file, "other" if kind == "foreign" else "mine")
    data = file.read_bytes()
    if kind == "corrupt":
        file.write_bytes(b"not a store" + data[11:])
    elif kind == "truncated":
        file.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "foreign"])
def test_unusable_store_files_are_moved_aside_in_one_sentence(tmp_path, kind):
    from mlx_dspark.proposers.suffix_files import open_store

    file = tmp_path / "store.npz"
    bad_store(file, kind)
    before = file.read_bytes()
    store, note = open_store(file, "mine")
    assert store.num_documents == 0  # a fresh store
    words = {"corrupt": "corrupt or truncated", "truncated": "corrupt or truncated"}
    assert words.get(kind, "another tokenizer") in note
    assert note.count(". ") == 0 and note.endswith(".") and "\n" not in note
    assert not file.exists()
    assert (tmp_path / "store.npz.bad").read_bytes() == before
    # A second bad file does not overwrite the first one moved aside.
    bad_store(file, kind)
    _, again = open_store(file, "mine")
    assert "store.npz.bad.1" in again
    assert (tmp_path / "store.npz.bad").read_bytes() == before
    # No file: a fresh store and nothing to say.
    assert open_store(tmp_path / "none.npz", "mine")[1] is None


def test_cli_refuses_a_corrupt_store_in_one_sentence_and_keeps_it(family, tmp_path):
    _, _, path = family("qwen3")
    file = tmp_path / "store.npz"
    bad_store(file, "corrupt")
    before = file.read_bytes()
    common = ["--model", str(path), "-p", "t5 t7 t1 t2", "-m", "20"]
    common += ["--ignore-chat-template", "--verbose", "false"]
    result = run(*common, "--dspark-suffix", "--dspark-suffix-store", str(file))
    assert result.returncode == 0, result.stderr
    said = [x for x in result.stderr.splitlines() if "suffix store" in x]
    assert len(said) == 1 and "moved to" in said[0] and "Traceback" not in result.stderr
    assert (tmp_path / "store.npz.bad").read_bytes() == before
    assert SuffixStore.load(file, _fingerprint(path)).num_documents == 1


def _fingerprint(path) -> str:
    from mlx_dspark.proposers.suffix_files import tokenizer_fingerprint

    return tokenizer_fingerprint(fresh_tokenizer(path))
