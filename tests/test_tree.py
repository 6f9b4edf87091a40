"""Tree mode: greedy identity, exact sampling, the tree forward and the cache."""

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import HEADS, head_id
from test_cli import run
from test_sampling import PROMPT, chi_square, chi_square_critical, exact_joint

from mlx_dspark import stream_generate
from mlx_dspark.decoding.loop import prefill, speculative_generate_step
from mlx_dspark.decoding.modes import ChainMode, TreeMode
from mlx_dspark.errors import DSparkError
from mlx_dspark.proposers.base import Proposal, Round
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.proposers.dspark import DrafterProposer
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter

PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 11, 9]]
MAX_TOKENS = 48
BUDGETS = [4, 8, 16]
SEEDS = 2000


def target_greedy(model, prompt, max_tokens=MAX_TOKENS):
    from mlx_lm.generate import generate_step

    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]


@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_tree_greedy_identical_every_head_and_budget(pair_factory, head):
    model, tokenizer, drafter, *_ = pair_factory(markov_head_type=head, block_size=8)
    lengths = {}
    for budget in BUDGETS:
        rounds = []
        for prompt in PROMPTS:
            expected = target_greedy(model, prompt)
            for num_draft in (3, 8):
                responses = list(
                    stream_generate(
                        model,
                        tokenizer,
                        drafter,
                        prompt,
                        max_tokens=MAX_TOKENS,
                        num_draft=num_draft,
                        tree_budget=budget,
                    )
                )
                assert [r.token for r in responses] == expected, (budget, prompt)
                assert responses[-1].generation_tokens == MAX_TOKENS
                if num_draft == 8:
                    rounds += responses[-1].stats.rounds
        lengths[budget] = np.mean([r.accepted + 1 for r in rounds])
    assert lengths[4] > 1.5
    assert lengths[16] >= lengths[4]


def test_tree_forward_matches_root_path_forwards(pair_factory):
    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompt = [1, 2, 3, 4, 5]
    tokens = [5, 6, 7, 8, 9, 10, 11]
    parents = [-1, 0, 0, 1, 2, 2, 4]
    for force_reference in (False, True):
        cache = target.make_cache()
        target(mx.array([prompt]), cache)
        logits, features = target.tree_forward(
            mx.array([tokens]), parents, cache, force_reference=force_reference
        )
        assert cache[0].offset == len(prompt) + len(tokens)
        for i in range(len(tokens)):
            path, j = [], i
            while j >= 0:
                path.append(tokens[j])
                j = parents[j]
            ref_logits, ref_features = target(
                mx.array([prompt + path[::-1]]), target.make_cache()
            )
            assert mx.allclose(logits[0, i], ref_logits[0, -1], atol=1e-4)
            assert mx.allclose(features[0, i], ref_features[0, -1], atol=1e-4)
    # A node attending to a sibling instead of its parent would change its logits.
    wrong, _ = target.tree_forward(
        mx.array([tokens]), [-1, 0, 1, 1, 2, 2, 4], target.make_cache()
    )
    assert not mx.allclose(wrong[0, 2], logits[0, 2], atol=1e-3)


def _tree_round(target, drafter, prompt, mode, params, seed):
    """Prefill, then one tree round; returns the cache and the committed tokens."""
    proposer = DrafterProposer(drafter)
    cache, draft_cache = target.make_cache(), proposer.make_state()
    logits, context = prefill(target, mx.array(prompt), cache)
    anchor = int(mx.argmax(logits).item())
    key = mx.random.key(seed)
    round = Round([*prompt, anchor], context, drafter.block_size, params, key)
    proposal = mode.propose(proposer, draft_cache, round)
    rng = np.random.default_rng(seed)
    result, accepted, features = mode.verify(
        target, cache, anchor, proposal, drafter.block_size, params, rng
    )
    return cache, anchor, accepted, result, features


def _assert_same_cache(cache, chain_cache, length):
    for tree_layer, chain_layer in zip(cache, chain_cache, strict=True):
        assert tree_layer.offset == chain_layer.offset == length
        for a, b in (
            (tree_layer.keys, chain_layer.keys),
            (tree_layer.values, chain_layer.values),
        ):
            assert mx.allclose(a[:, :, :length], b[:, :, :length], atol=1e-5)


def test_cache_after_branching_tree_equals_chain_run(pair_factory):
    """A hand-made tree whose accepted path takes second children twice."""
    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompt = [3, 14, 15]
    greedy = target_greedy(model, prompt, max_tokens=5)
    anchor, g1, g2, g3, g4 = greedy
    wrong = [(g + 1) % 30 for g in greedy]
    # node: 1 wrong, 2 = g1 (sibling), 3 under 1, 4 wrong under 2, 5 = g2 under 2,
    # 6 = g3 under 5. Expected path [0, 2, 5, 6], then g4.
    tokens = [wrong[1], g1, g2, wrong[2], g2, g3]
    parents = [0, 0, 1, 2, 2, 5]
    proposal = Proposal(
        mx.array([tokens], dtype=mx.int32),
        mx.zeros((1, len(tokens), 1)),
        extra={"parents": parents},
    )
    cache = target.make_cache()
    prefill(target, mx.array(prompt), cache)
    mode = TreeMode(8)
    result, accepted, features = mode.verify(
        target, cache, anchor, proposal, 8, SamplingParams(), None
    )
    assert mode.rounds[-1].path == [0, 2, 5, 6]
    assert accepted == [g1, g2, g3] and result.next_token == g4
    chain_cache = target.make_cache()
    prefill(target, mx.array(prompt), chain_cache)
    chain_result, _, chain_features = ChainMode().verify(
        target,
        chain_cache,
        anchor,
        Proposal(mx.array([[g1, g2, g3]]), mx.zeros((1, 3, 1))),
        3,
        SamplingParams(),
        None,
    )
    assert chain_result == result
    _assert_same_cache(cache, chain_cache, len(prompt) + 4)
    assert mx.allclose(features, chain_features, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_after_tree_round_equals_chain_run(pair_factory, temperature):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    params = SamplingParams(temperature=temperature)
    prompts = [[3, 14, 15], [1, 2, 3], [7, 8], [20, 4, 11, 9], [5], [9, 9, 2]]
    for seed, prompt in enumerate(prompts):
        cache, anchor, accepted, result, features = _tree_round(
            target, drafter, prompt, TreeMode(8), params, seed
        )
        # A chain run that commits the same tokens.
        chain_cache = target.make_cache()
        prefill(target, mx.array(prompt), chain_cache)
        if params.greedy:
            drafts = mx.array([accepted], dtype=mx.int32)
            chain_result, _, chain_features = ChainMode().verify(
                target,
                chain_cache,
                anchor,
                Proposal(drafts, mx.zeros((1, len(accepted), 1))),
                len(accepted),
                params,
                None,
            )
            assert chain_result == result
        else:
            _, chain_features = target(mx.array([[anchor, *accepted]]), chain_cache)
        _assert_same_cache(cache, chain_cache, len(prompt) + len(accepted) + 1)
        assert features.shape[1] == len(accepted) + 1
        assert mx.allclose(features, chain_features, atol=1e-5)


def sample_first_three(model, drafter, params, make_mode, seeds=SEEDS):
    """The first three tokens of ``seeds`` runs; rounds may draft up to depth 4."""
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    samples, modes = Counter(), []
    for seed in range(seeds):
        modes.append(make_mode())
        tokens = speculative_generate_step(
            mx.array(PROMPT),
            target,
            pair_proposer(drafter),
            num_draft=drafter.block_size,
            params=params,
            max_tokens=6,
            seed=seed,
            mode=modes[-1],
            sampling="residual",  # the recursive rejection sampling under test
        )
        samples[tuple(t for t, _ in itertools.islice(tokens, 3))] += 1
    return samples, [r for m in modes for r in m.rounds]


class FixedDraftTree(TreeMode):
    """A wrong verifier: siblings are drawn without replacement, but the
    draft distribution is not renormalised after a rejected sibling."""

    def rejection_step(self, p, q, x, rng):
        accepted, p, _ = super().rejection_step(p, q, x, rng)
        return accepted, p, q


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_tree_sampling_exact(pair_factory, head):
    # At sharpness 0.6 the RNN head's drafts are so peaked that about 1% of
    # its trees have siblings, and a path through one came down to one seed
    # of 2,000; at 0.45 several seeds take one.
    sharpness = 0.45 if head == "rnn" else 0.6
    model, _, drafter, *_ = pair_factory(
        markov_head_type=head, sharpness=sharpness, block_size=4
    )
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(model, params)
    samples, rounds = sample_first_three(model, drafter, params, lambda: TreeMode(6))
    stat, dof = chi_square(samples, joint, SEEDS)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    trees = [r for r in rounds if r.nodes]
    assert max(r.depth for r in trees) >= 2
    assert any(r.nodes > r.depth for r in trees)  # some siblings
    assert any(r.path != list(range(len(r.path))) for r in trees)
    assert 0 < np.mean([r.accepted for r in trees]) < 3


def test_the_statistical_test_catches_an_unrenormalised_draft(pair_factory):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(model, params)
    samples, _ = sample_first_three(model, drafter, params, lambda: FixedDraftTree(6))
    stat, dof = chi_square(samples, joint, SEEDS)
    assert stat > chi_square_critical(dof)


def test_tree_budget_errors(pair_factory):
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    with pytest.raises(DSparkError):
        list(stream_generate(model, tokenizer, drafter, [1], tree_budget=-1))


def test_cli_dspark_tree(pair_factory):
    *_, target_dir, drafter_dir, _ = pair_factory(block_size=8)
    common = ["--model", str(target_dir), "--draft-model", str(drafter_dir)]
    common += ["-p", "t1 t2 t3", "-m", "24", "--verbose", "false"]
    chain, tree = run(*common), run(*common, "--dspark-tree", "6")
    assert chain.returncode == tree.returncode == 0, tree.stderr
    assert tree.stdout == chain.stdout
    bad = run(*common, "--dspark-tree", "-2")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--dspark-tree must be >= 0" in bad.stderr
