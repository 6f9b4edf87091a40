"""Drafted stop tokens: an EAGLE-3 chain ends at one, as DeepSpec's evaluator's
``_propose`` ends it, and the default policy never verifies drafts past one,
whatever the proposer; the committed tokens do not change."""

from dataclasses import dataclass, field

import mlx.core as mx
import pytest
from test_eagle3_loop import DATA, ROUNDS, Recording

import mlx_dspark
from mlx_dspark.decoding.loop import (
    GenerationStats,
    ThresholdPolicy,
    speculative_generate_step,
)
from mlx_dspark.policy.policies import resolve_policy
from mlx_dspark.policy.settings import build_settings
from mlx_dspark.proposers.base import Proposal, cut_at_stop
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.targets.adapter import TargetAdapter

# A token DeepSpec's EAGLE-3 drafter drafts in the fixtures' runs (mostly
# late in a chain) and the target never emits there.
STOP = 21


def test_cut_at_stop():
    assert cut_at_stop([4, 2, 21, 16], {21}) == 3
    assert cut_at_stop([21, 2], {21, 5}) == 1
    assert cut_at_stop(mx.array([[4, 2, 16]]), {21}) == 3
    assert cut_at_stop([4, 2], ()) == 2


@pytest.fixture(scope="module")
def eagle3_pair():
    return mlx_dspark.load(DATA / "target", DATA / "qwen3")


def test_eagle3_chains_end_at_a_drafted_stop_as_deepspec(eagle3_pair):
    """With a stop token, each round verifies DeepSpec's chain up to its
    first drafted stop token (the fixtures' drafts, cut where the
    evaluator's ``_propose`` breaks), keeps the rounds' accepted lengths and
    commits the same tokens; without one, the full 7 as before."""
    model, _, drafter = eagle3_pair
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    cut_somewhere = False
    for run in ROUNDS["runs"]:
        lengths = run["acceptance_lengths"]
        expected = [cut_at_stop(d, {STOP}) for d in run["drafts"]]
        cut_somewhere |= any(n < 7 for n in expected)
        max_tokens = 1 + sum(lengths) + 7
        policy, stats = Recording(), GenerationStats()
        steps = speculative_generate_step(
            mx.array(run["prompt"]), target, pair_proposer(drafter), num_draft=7,
            max_tokens=max_tokens, policy=policy, stats=stats, stop_ids={STOP},
        )  # fmt: skip
        tokens = [t for t, _ in steps]
        assert tokens[: ROUNDS["max_new_tokens"]] == run["output"]
        rounds = stats.rounds[: len(lengths)]
        assert [r.verified for r in rounds] == expected
        assert [r.accepted + 1 for r in rounds] == lengths
        drafts = [d[:n] for d, n in zip(run["drafts"], expected, strict=True)]
        assert policy.drafts[: len(lengths)] == drafts
    assert cut_somewhere


@dataclass
class CutThreshold(ThresholdPolicy):
    """Every draft verified, but never past a drafted stop token (the
    default policy's rule); the proposals recorded."""

    cut_at_stop: bool = True
    proposals: list = field(default_factory=list)

    def observe(self, proposal: Proposal, round_stats) -> None:
        if round_stats.drafted:
            self.proposals.append((proposal.tokens[0].tolist(), round_stats))


def test_default_policy_rule_ends_a_dspark_chain_at_a_drafted_stop(pair_factory):
    """A DSpark block keeps its length, but the loop verifies it only up to
    a drafted stop token under a policy with ``cut_at_stop`` (the default
    one); the tokens are those of the run without stop tokens."""
    model, _, drafter, *_ = pair_factory(markov_head_type="vanilla", block_size=5)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompt = mx.array([3, 14, 15, 9])

    def run(policy, stop_ids=()):
        steps = speculative_generate_step(
            prompt, target, pair_proposer(drafter), num_draft=5, max_tokens=40,
            policy=policy, stop_ids=stop_ids,
        )  # fmt: skip
        return [t for t, _ in steps]

    free = CutThreshold()
    expected = run(free)
    # A token drafted before the block's end in some round.
    stop = next(d[i] for d, _ in free.proposals for i in range(len(d) - 1))
    policy = CutThreshold()
    assert run(policy, {stop}) == expected
    cuts = 0
    for drafts, stats in policy.proposals:
        assert len(drafts) == stats.drafted  # the block keeps its length
        assert stats.verified == cut_at_stop(drafts, {stop})
        cuts += stats.verified < len(drafts)
    assert cuts > 0
    # Without the rule (a fixed draft count) the whole block is verified.
    fixed = Recording()
    assert run(fixed, {stop}) == expected


def test_only_the_default_policy_cuts(pair_factory):
    model, _, drafter, *_ = pair_factory(markov_head_type="vanilla", block_size=5)
    default = resolve_policy(model, drafter, build_settings(drafter.block_size))
    assert default.policy.cut_at_stop
    fixed = resolve_policy(model, drafter, build_settings(drafter.block_size, 5))
    assert not getattr(fixed.policy, "cut_at_stop", False)
