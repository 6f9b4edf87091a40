"""EAGLE-3 drafters through the one generation loop (:class:`Eagle3Proposer`):
greedy rounds as DeepSpec's evaluator runs them, exact and seeded sampling,
proposers mixed within one generation, the generate CLI and the server.

The fixtures in tests/data/eagle3/ are DeepSpec's evaluator's own rounds
(see tests/eagle3_chain.py, which runs them outside the loop)."""

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_dspark.convert.__main__ import main as convert_main
from test_eagle3 import (  # noqa: F401 (a fixture)
    SAMPLING_PROMPT,
    SAMPLING_SEEDS,
    reduced_copy,
    small_pair,
)
from test_greedy import target_greedy
from test_sampling import (
    chi_square,
    chi_square_critical,
    exact_joint,
    sample_first_three,
)
from test_seed import SEEDS, SETTINGS, dspark_tokens, mlx_lm_tokens, served, served_as

import mlx_dspark
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.decoding.loop import (
    GenerationStats,
    ThresholdPolicy,
    speculative_generate_step,
)
from mlx_dspark.errors import DSparkError
from mlx_dspark.generation import stream_generate
from mlx_dspark.policy.calibrate import calibrate_pair
from mlx_dspark.policy.policies import MonitoredPolicy
from mlx_dspark.proposers.base import Proposal, Round
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.proposers.eagle3 import Eagle3Drafter, Eagle3Proposer
from mlx_dspark.proposers.suffix_store import SuffixStore
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.serving import BatchEngine, EngineConfig, GenerationRequest
from mlx_dspark.targets.adapter import TargetAdapter

DATA = Path(__file__).parent / "data" / "eagle3"
ROUNDS = json.loads((DATA / "qwen3_rounds.json").read_text())


@pytest.fixture(scope="module")
def pair():
    """The fixtures' target, its tokenizer and DeepSpec's EAGLE-3 drafter,
    loaded as a user loads a pair."""
    return mlx_dspark.load(DATA / "target", DATA / "qwen3")


@dataclass
class Recording(ThresholdPolicy):
    """Every drafted round verified in full; its drafts recorded."""

    drafts: list[list[int]] = field(default_factory=list)

    def observe(self, proposal: Proposal, round_stats) -> None:
        if round_stats.drafted:
            self.drafts.append(proposal.tokens[0].tolist())


@pytest.mark.parametrize("source", ["qwen3", "speculators_qwen3"])
def test_greedy_rounds_through_the_loop_match_deepspec_evaluator(pair, source):
    """Fixed 7 drafts, no threshold, no scheduler: DeepSpec's evaluator's
    tokens, accepted length per round and (its own checkpoint) drafts."""
    model, tokenizer, _ = pair
    drafter = mlx_dspark.load(DATA / "target", DATA / source)[2]
    assert isinstance(drafter, Eagle3Drafter) and drafter.block_size == 7
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for run in ROUNDS["runs"]:
        lengths = run["acceptance_lengths"]
        # Room for a full round after the fixture's last one: every round
        # drafts 7, as the evaluator's do.
        max_tokens = 1 + sum(lengths) + 7
        policy, stats = Recording(), GenerationStats()
        steps = speculative_generate_step(
            mx.array(run["prompt"]), target, pair_proposer(drafter), num_draft=7,
            max_tokens=max_tokens, policy=policy, stats=stats,
        )  # fmt: skip
        tokens = [t for t, _ in steps]
        assert tokens[: ROUNDS["max_new_tokens"]] == run["output"]
        assert [r.accepted + 1 for r in stats.rounds][: len(lengths)] == lengths
        assert all(r.drafted == 7 for r in stats.rounds[: len(lengths)])
        if source == "qwen3":
            assert policy.drafts[: len(lengths)] == run["drafts"]
        # stream_generate, with the same setup, commits the same rounds.
        responses = list(
            stream_generate(
                model, tokenizer, drafter, run["prompt"], max_tokens=max_tokens,
                num_draft=7, confidence_threshold=0.0, scheduler="off",
            )
        )  # fmt: skip
        assert [r.token for r in responses] == tokens
        rounds = responses[-1].stats.rounds
        assert [r.accepted + 1 for r in rounds][: len(lengths)] == lengths


class FlatRows(Eagle3Proposer):
    """A wrong proposer: it claims uniform rows, not the ones it drew from."""

    def propose(self, state, round: Round) -> Proposal:
        proposal = super().propose(state, round)
        proposal.logits = mx.zeros_like(proposal.logits)
        return proposal


def sampled(
    model, drafter, params, proposer=None, seeds=SAMPLING_SEEDS, sampling="residual"
):
    """The first three tokens' counts over ``seeds`` generations whose
    first round drafts 3, and the rounds' stats."""
    return sample_first_three(
        model, drafter, params, seeds=seeds, prompt=SAMPLING_PROMPT,
        proposer=proposer, num_draft=3, max_tokens=5, sampling=sampling,
    )  # fmt: skip


@pytest.mark.parametrize(
    "params,reduced",
    [
        (SamplingParams(temperature=1.0), False),
        (SamplingParams(temperature=0.7, top_p=0.9, top_k=6), True),
    ],
)
def test_sampling_through_the_loop_is_exact(small_pair, tmp_path, params, reduced):  # noqa: F811
    model, drafter_dir = small_pair
    if reduced:
        drafter_dir = reduced_copy(drafter_dir, tmp_path / "reduced", [2, 7])
    drafter = load_drafter(drafter_dir, model)
    assert drafter.config.reduced_vocab == reduced
    samples, stats = sampled(model, drafter, params)
    joint = exact_joint(model, params, SAMPLING_PROMPT)
    stat, dof = chi_square(samples, joint, SAMPLING_SEEDS)
    assert stat < chi_square_critical(dof), (stat, dof)
    # The speculative path was taken: drafts kept in some rounds, not all.
    accepted = [r.accepted for r in stats.rounds if r.drafted]
    assert 0 < np.mean(accepted) < 3


def test_a_wrong_proposal_fails_the_loop_s_sampling_test(small_pair):  # noqa: F811
    """The test above can fail: verifying against rows other than the ones
    the drafts were drawn from biases the output."""
    model, drafter_dir = small_pair
    drafter = load_drafter(drafter_dir, model)
    params = SamplingParams(temperature=1.0)
    seeds = SAMPLING_SEEDS // 2
    samples, _ = sampled(model, drafter, params, FlatRows(drafter), seeds)
    stat, dof = chi_square(samples, exact_joint(model, params, SAMPLING_PROMPT), seeds)
    assert stat > chi_square_critical(dof)


@pytest.mark.parametrize("sampling", ["residual", "coupled"])
def test_sampling_with_copies_biasing_eagle3_rows_is_exact(small_pair, sampling):  # noqa: F811
    """The phrase store's copies bias the EAGLE-3 rows (and go on past
    them): drafts are drawn from the biased rows, so the output stays exact."""
    model, drafter_dir = small_pair
    drafter = load_drafter(drafter_dir, model)
    drafter.config.context_copy_bias = 40.0
    drafter.phrase_store = walk_store(model, [SAMPLING_PROMPT], 8)
    params = SamplingParams(temperature=1.0)
    samples, stats = sampled(model, drafter, params, sampling=sampling)
    joint = exact_joint(model, params, SAMPLING_PROMPT)
    stat, dof = chi_square(samples, joint, SAMPLING_SEEDS)
    assert stat < chi_square_critical(dof), (stat, dof)
    copied = [r for r in stats.rounds if r.phrases_offered and r.drafted]
    assert len(copied) > SAMPLING_SEEDS // 4
    assert 0 < np.mean([r.accepted for r in copied]) < 3


@pytest.mark.parametrize("name", ["t1", "t0.8-minp-k"])
@pytest.mark.parametrize("policy", ["default", "fixed"])
def test_seeded_coupled_sampling_is_mlx_lm_own(pair, name, policy):
    model, tokenizer, drafter = pair
    params = SETTINGS[name]
    extra = {} if policy == "default" else {"num_draft": 7, "scheduler": "off"}
    kept = 0
    for seed in SEEDS:
        expected = mlx_lm_tokens(model, tokenizer, params, seed)
        tokens, stats = dspark_tokens(model, tokenizer, drafter, params, seed, **extra)
        assert tokens == expected, seed
        kept += sum(r.accepted for r in stats.rounds)
    if policy == "fixed":
        assert kept > 0


def walk_store(model, prompts: list[list[int]], length: int) -> SuffixStore:
    """A phrase store of the target's greedy text after each prompt."""
    store = SuffixStore()
    store.add_documents(
        [p + target_greedy(model, p, max_tokens=length) for p in prompts]
    )
    return store


@dataclass
class EveryThirdPlain(MonitoredPolicy):
    """The default policy's monitoring, with every third round plain."""

    rounds: int = 0

    def round_cap(self, cap: int, copy: bool = False, phrases: bool = False) -> int:
        self.rounds += 1
        return 0 if self.rounds % 3 == 0 else super().round_cap(cap, copy, phrases)


def test_mixed_proposers_stay_greedy_identical(pair):
    """EAGLE-3 rounds, context copies, the phrase store's copies and plain
    rounds within one generation commit the target's own greedy tokens."""
    model, tokenizer, _ = pair
    drafter = mlx_dspark.load(DATA / "target", DATA / "qwen3")[2]
    drafter.config.context_copy_bias = 1.0  # the pair copies
    prompts = [[1, 2, 3], [7, 9, 11, 13], [20, 4, 11, 9], [5, 6]]
    # The store knows how the first prompts go on, not the last ones.
    drafter.phrase_store = walk_store(model, prompts[:2], 24)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    kinds = Counter()
    for prompt in prompts:
        expected = target_greedy(model, prompt, max_tokens=40)
        for as_is in (False, True):
            stats = GenerationStats()
            steps = speculative_generate_step(
                mx.array(prompt), target, pair_proposer(drafter, 12, as_is),
                num_draft=7, max_tokens=40, policy=EveryThirdPlain(), stats=stats,
            )  # fmt: skip
            assert [t for t, _ in steps] == expected, (prompt, as_is)
            kinds.update(
                "plain" if not r.drafted
                else "phrases" if r.phrases_offered
                else "copy" if r.copy_offered
                else "own"
                for r in stats.rounds
            )  # fmt: skip
        # The default policy (adaptive, its cost profile measured) too.
        responses = list(stream_generate(model, tokenizer, drafter, prompt, 40))
        tokens = [r.token for r in responses]
        assert tokens == expected[: len(tokens)] and len(tokens) > 1, prompt
        assert responses[-1].telemetry.policy == "adaptive"
    assert min(kinds["plain"], kinds["copy"], kinds["phrases"], kinds["own"]) > 0, kinds


def test_trees_refuse_the_eagle3_proposer(pair):
    model, tokenizer, drafter = pair
    tree = stream_generate(model, tokenizer, drafter, [1, 2, 3], 8, tree_budget=8)
    with pytest.raises(DSparkError, match="Eagle3Proposer proposes chains only"):
        list(tree)


def generate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark.generate", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )


def test_generate_cli_runs_a_converted_4bit_eagle3_draft(tmp_path, capsys):
    out = tmp_path / "q4"
    convert_main(
        ["--draft-model", str(DATA / "qwen3"), "--out", str(out), "-q",
         "--q-group-size", "32"]
    )  # fmt: skip
    assert "4-bit MLX EAGLE-3 drafter" in capsys.readouterr().out
    common = ["--model", str(DATA / "target"), "-p", "t1 t2 t3", "-m", "24"]
    drafted = generate_cli(*common, "--draft-model", str(out))
    plain = generate_cli(*common, "--verbose", "false")
    assert drafted.returncode == 0 and plain.returncode == 0, (
        drafted.stderr + plain.stderr
    )
    text = drafted.stdout.split("=" * 10)[1].strip()
    assert text == plain.stdout.strip() and len(text.split()) == 24
    assert "Mean accepted length:" in drafted.stdout


def test_server_takes_an_eagle3_drafter(pair):
    """Greedy and seeded requests through the batch engine are mlx-lm's."""
    model, tokenizer, drafter = pair
    engine = BatchEngine(model, tokenizer, drafter, EngineConfig(max_batch=4))
    assert isinstance(engine.proposer, Eagle3Proposer)
    try:
        greedy = SamplingParams()
        handles = {
            (name, seed): engine.submit(
                GenerationRequest([3, 14, 15, 9], params, 24, seed)
            )
            for name, params in [("greedy", greedy), ("t1", SETTINGS["t1"])]
            for seed in SEEDS[:2]
        }
        engine.start()
        for (name, seed), handle in handles.items():
            params = greedy if name == "greedy" else SETTINGS[name]
            expected = mlx_lm_tokens(model, tokenizer, params, seed)
            assert served(handle) == served_as(expected, tokenizer), (name, seed)
        assert engine.stats.drafts_accepted > 0  # its drafts were verified
    finally:
        engine.stop()


def test_calibration_names_the_missing_confidence_head(pair):
    model, tokenizer, drafter = pair
    with pytest.raises(DSparkError, match="no confidence head to calibrate"):
        calibrate_pair(model, tokenizer, drafter, rounds=10, plot=False)
