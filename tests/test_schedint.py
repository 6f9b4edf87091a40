"""The scheduler wired into the generation loop: lossless (greedy identity and an
exact sampling test that a future-peeking scheduler fails), calibration CLI,
cost profile cache, memory guard inside a generation, batched verification."""

import dataclasses
import importlib.util
import json
import math
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlx_dspark import stream_generate
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.decoding.loop import ThresholdPolicy, speculative_generate_step
from mlx_dspark.decoding.modes import ChainMode
from mlx_dspark.loading import load
from mlx_dspark.policy.calibrate import (
    CALIBRATION_FILE,
    cached_calibration_path,
    collect_records,
    default_output,
    find_calibration,
    fit_records,
)
from mlx_dspark.policy.calibration import (
    CalibrationResult,
    apply_sts,
    expected_calibration_error,
    fit_sts_offset,
    prefix_labels,
    records_per_position,
    records_to_arrays,
)
from mlx_dspark.policy.memory import MemoryGuard, PressureLevel
from mlx_dspark.policy.policies import SchedulerPolicy, resolve_policy, verify_batch
from mlx_dspark.policy.profile import (
    get_profile,
    load_profile,
    profile_key,
    profile_path,
)
from mlx_dspark.policy.scheduler import SchedulerSettings, StepRateCurve, schedule
from mlx_dspark.policy.settings import build_settings
from mlx_dspark.policy.telemetry import render_prometheus
from mlx_dspark.proposers.base import Proposal
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.sampling.processing import SamplingParams, log_probs
from mlx_dspark.targets.adapter import TargetAdapter

PROMPTS = [[1, 2, 3], [20, 4, 11, 9], [13, 5, 5, 21, 2, 17]]
NO_WARMUP = SchedulerSettings(warmup_steps=0, n_draft_min=0)


def fitted(**parameters) -> CalibrationResult:
    """A calibration with these parameters and no measurements."""
    return CalibrationResult(ece_before=[], ece_after=[], auc_before=[],
                             auc_after=[], n_rounds=0, **parameters)  # fmt: skip


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    for name in (
        "DSPARK_SCHEDULER_ENABLED",
        "DSPARK_CONFIDENCE_THRESHOLD",
        "DSPARK_N_DRAFT_MIN",
        "DSPARK_N_DRAFT_MAX",
        "DSPARK_SCHEDULER_INTERVAL_MS",
        "DSPARK_WARMUP_STEPS",
    ):
        monkeypatch.delenv(name, raising=False)


def target_greedy(model, prompt, max_tokens):
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]


def run(target, drafter, prompt, policy, max_tokens, params=SamplingParams(), seed=0):
    return [
        t
        for t, _ in speculative_generate_step(
            mx.array(prompt),
            target,
            pair_proposer(drafter),
            num_draft=drafter.block_size,
            params=params,
            max_tokens=max_tokens,
            policy=policy,
            seed=seed,
        )
    ]


def test_greedy_identical_with_scheduler(pair_factory):
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    curves = [
        StepRateCurve.linear(1.0, 0.02),
        StepRateCurve.linear(1.0, 0.3),
        StepRateCurve.linear(0.1, 1.0, draft_seconds=0.5),
    ]
    lengths = set()
    for prompt in PROMPTS:
        expected = target_greedy(model, prompt, 48)
        for curve in curves:
            for calibration in (None, fitted(temperatures=[3.0] * 8)):
                policy = SchedulerPolicy(calibration, curve=curve, settings=NO_WARMUP)
                assert run(target, drafter, prompt, policy, 48) == expected
                lengths |= {r.admitted for r in policy.telemetry.recent}
    assert len(lengths) >= 3, lengths  # the scheduler really chose lengths
    # Through the public API, measuring and caching a profile on the way.
    responses = list(
        stream_generate(
            model, tokenizer, drafter, PROMPTS[0], max_tokens=48, scheduler="auto"
        )
    )
    assert [r.token for r in responses] == target_greedy(model, PROMPTS[0], 48)
    tele = responses[-1].telemetry
    assert tele.n_rounds == len(responses[-1].stats.rounds)
    text = render_prometheus(tele)
    for name in (
        "dspark_scheduler_n_current",
        "dspark_draft_acceptance_rate",
        "dspark_confidence_head_ece",
        "dspark_draft_length_tokens_bucket",
    ):
        assert name in text


# --- exact sampling ---------------------------------------------------------

CHI2_Z = 3.09  # one-sided normal quantile for p = 0.001


def chi2_critical(df: int, z: float = CHI2_Z) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class FuturePeekingScheduler:
    """WRONG on purpose: admits draft k only if the confidence of position k+1
    is high. That confidence reads x_k, the very draft being tested, so the
    verify/bonus split at k is correlated with x_k and the output is biased."""

    def draft_length(self, proposal, cap):
        z = np.array(proposal.confidence[0, :cap])
        n = 0
        while n < cap - 1 and z[n + 1] > 0.0:
            n += 1
        return n


def exact_joint(model, prompt, params, depth=3):
    def dist(prefix):
        logits = model(mx.array([prompt + prefix]))[0, -1]
        return np.exp(np.array(log_probs(logits, params), dtype=np.float64))

    joint = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, mass in joint.items():
            p = dist(list(prefix))
            for token in np.flatnonzero(p > 1e-12):
                grown[(*prefix, int(token))] = mass * p[token]
        joint = grown
    return joint


def chi2(counts, exact, n):
    assert set(counts) <= set(exact), "a sequence the target cannot produce"
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())


def first_tokens(target, drafter, prompt, make_policy, params, seeds, depth=3):
    counts = {}
    for seed in range(seeds):
        tokens = []
        for token, _ in speculative_generate_step(
            mx.array(prompt),
            target,
            pair_proposer(drafter),
            num_draft=drafter.block_size,
            params=params,
            max_tokens=depth + 2,
            policy=make_policy(),
            seed=seed,
            # Residual rejection sampling: a policy that peeks at the drafts
            # biases it (and these tests catch that); coupled output is
            # mlx-lm's own whatever the policy (test_seed).
            sampling="residual",
        ):
            tokens.append(token)
            if len(tokens) == depth:
                break
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


def random_drafts(model, drafter):
    """Soften the sequential head so that, at a high temperature, drafts are
    random; returns the target adapter, the sampling parameters, the prompt,
    the exact joint of the first tokens and the chi-square critical value."""
    head = drafter.markov_head
    head.markov_w2.weight = head.markov_w2.weight * 0.3
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    params = SamplingParams(temperature=4.0, top_k=2)
    prompt = [1, 2, 3]
    exact = exact_joint(model, prompt, params)
    return target, params, prompt, exact, chi2_critical(len(exact) - 1)


def test_sampling_exact_with_scheduler_and_peeking_scheduler_fails(pair_factory):
    *_, target_dir, drafter_dir, spec = pair_factory(
        block_size=4, sharpness=0.5, seed=3
    )
    model, _, drafter = load(target_dir, drafter_dir)
    # Make the confidence of position k depend strongly on x_{k-1} (W1 rows are
    # one-hot codes here): +4 after even tokens, -4 after odd ones.
    d = spec.hidden_size
    weight = np.zeros((1, d + spec.code_dims), np.float32)
    weight[0, d:] = np.where(np.arange(spec.code_dims) % 2 == 0, 4.0, -4.0)
    drafter.confidence_head.proj.weight = mx.array(weight)
    drafter.confidence_head.proj.bias = mx.zeros((1,))
    target, params, prompt, exact, critical = random_drafts(model, drafter)

    curve = StepRateCurve.linear(1.0, 0.3)
    made = []

    def real():
        made.append(SchedulerPolicy(None, curve=curve, settings=NO_WARMUP))
        return made[-1]

    n = 2000
    counts = first_tokens(target, drafter, prompt, real, params, n)
    stat = chi2(counts, exact, n)
    assert stat < critical, (stat, critical, counts)
    admitted = {r.admitted for p in made for r in p.telemetry.recent}
    assert len(admitted) >= 3, admitted  # the scheduler made real decisions

    n_bad = 1000
    bad = first_tokens(target, drafter, prompt, FuturePeekingScheduler, params, n_bad)
    stat_bad = chi2(bad, exact, n_bad)
    assert stat_bad > critical, (stat_bad, critical, bad)


class DrawnTokenScheduler(SchedulerPolicy):
    """WRONG on purpose: reads the log-probability of the token drawn at
    position k where the calibration expects the top of its distribution, so
    whether draft k is verified depends on x_k itself."""

    def survival(self, proposal, cap, row=0):
        logits = proposal.logits[:, :cap].astype(mx.float32)
        drawn = mx.take_along_axis(logits, proposal.tokens[:, :cap, None], axis=-1)
        drawn = drawn[..., 0] - mx.logsumexp(logits, axis=-1)
        peeking = Proposal(proposal.tokens, proposal.logits, proposal.confidence,
                           top_logprob=drawn)  # fmt: skip
        return super().survival(peeking, cap, row)


def test_sampling_exact_when_the_calibration_reads_the_drafts_top_probability(
    pair_factory,
):
    """A calibration that weighs the top log-probability of each draft's
    distribution keeps sampling exact; the same weight on the drawn token's
    own log-probability does not."""
    *_, target_dir, drafter_dir, _ = pair_factory(block_size=4, sharpness=0.5, seed=3)
    model, _, drafter = load(target_dir, drafter_dir)
    target, params, prompt, exact, critical = random_drafts(model, drafter)
    calibration = fitted(temperatures=[1e3] * 4, top_weights=[60.0] * 4,
                         offsets=[8.4] * 4)  # fmt: skip
    curve = StepRateCurve.linear(1.0, 0.3)
    made = []

    def real():
        made.append(SchedulerPolicy(calibration, curve=curve, settings=NO_WARMUP))
        return made[-1]

    def wrong():
        return DrawnTokenScheduler(calibration, curve=curve, settings=NO_WARMUP)

    n = 2000
    counts = first_tokens(target, drafter, prompt, real, params, n)
    stat = chi2(counts, exact, n)
    assert stat < critical, (stat, critical, counts)
    admitted = {r.admitted for p in made for r in p.telemetry.recent}
    assert len(admitted) >= 3, admitted  # the top log-probabilities decided

    bad = first_tokens(target, drafter, prompt, wrong, params, n)
    stat_bad = chi2(bad, exact, n)
    assert stat_bad > critical, (stat_bad, critical, bad)


# --- batched verification -----------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_batch_equals_single(pair_factory, temperature):
    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    params = SamplingParams(temperature=temperature)
    prompts = [[1, 2, 3], [20, 4, 11, 9, 7, 7, 1], [5]]
    lengths = [5, 0, 8]
    caches_single, caches_batch, anchors, proposals = [], [], [], []
    for r, prompt in enumerate(prompts):
        single, batch = target.make_cache(), target.make_cache()
        for cache in (single, batch):
            logits, features = target(mx.array([prompt]), cache)
        anchor = int(mx.argmax(logits[0, -1]).item())
        draft_cache = drafter.make_cache()
        hidden = drafter(
            drafter.block_tokens(mx.array([anchor])), len(prompt), features, draft_cache
        )
        proposal = drafter.propose(
            hidden, mx.array([anchor]), 8, params, mx.random.key(r)
        )
        caches_single.append(single)
        caches_batch.append(batch)
        anchors.append(anchor)
        proposals.append(proposal)
    singles = [
        ChainMode().verify(target, c, a, p, n, params, np.random.default_rng(r))
        for r, (c, a, p, n) in enumerate(
            zip(caches_single, anchors, proposals, lengths, strict=True)
        )
    ]
    batched = verify_batch(
        target,
        caches_batch,
        anchors,
        proposals,
        lengths,
        params,
        [np.random.default_rng(r) for r in range(len(prompts))],
    )
    for (v1, d1, f1), (v2, d2, f2), c1, c2 in zip(
        singles, batched, caches_single, caches_batch, strict=True
    ):
        assert (v1.accepted, v1.next_token) == (v2.accepted, v2.next_token)
        assert d1 == d2
        assert mx.allclose(f1, f2, atol=1e-4).item()
        for l1, l2 in zip(c1, c2, strict=True):
            assert l1.offset == l2.offset
            k1 = l1.state[0][..., : l1.offset, :]
            k2 = l2.state[0][..., : l2.offset, :]
            assert mx.allclose(k1, k2, atol=1e-4).item()
    assert any(v.accepted > 0 for v, _, _ in singles)
    # Batched scheduling: one Algorithm 1 call over all requests.
    policy = SchedulerPolicy(
        None, curve=StepRateCurve.linear(1.0, 0.1), settings=NO_WARMUP
    )
    got = policy.draft_lengths(proposals, [8, 8, 8])
    want = schedule([policy.survival(p, 8) for p in proposals], policy.curve, [8, 8, 8])
    assert got == want


def test_request_batch_equals_single_caches(pair_factory):
    """Rows of a RequestBatch that join, verify chains of different lengths,
    keep different numbers of tokens and leave give every request the logits
    and features its own cache gives it."""
    from mlx_dspark.targets.adapter import RequestBatch

    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    rng = np.random.default_rng(0)
    batch, own, rows = RequestBatch(), [], []

    def join(prompt):
        single, joining = target.make_cache(), target.make_cache()
        for cache in (single, joining):
            target(mx.array([prompt]), cache)
        own.append(single)
        rows.append(batch.join(joining))

    join([1, 2, 3])
    join([20, 4, 11, 9, 7, 7, 1])
    for step in range(8):
        if step == 3:
            join([5])
        if step == 5:
            batch.leave(rows.pop(1))
            own.pop(1)
        chains = [rng.integers(0, 30, size=rng.integers(1, 6)).tolist() for _ in rows]
        outputs = target.forward_rows(chains, rows)
        for chain, cache, row, (logits, features) in zip(
            chains, own, rows, outputs, strict=True
        ):
            want_logits, want_features = target(mx.array([chain]), cache)
            assert logits.shape == want_logits.shape
            assert mx.allclose(logits, want_logits, atol=1e-4).item()
            assert mx.allclose(features, want_features, atol=1e-4).item()
            rejected = int(rng.integers(0, len(chain)))
            target.rollback(cache, rejected)
            target.rollback(row, rejected)
    batch.settle()
    assert any(batch.layers[0].left_padding.tolist())
    for row in list(rows):
        batch.leave(row)
    assert batch.rows == [] and batch.nbytes == 0


# --- memory guard ---------------------------------------------------------------


class FakeSource:
    def __init__(self, levels):
        self.levels, self.calls = list(levels), 0

    def __call__(self):
        level = self.levels[min(self.calls, len(self.levels) - 1)]
        self.calls += 1
        if isinstance(level, Exception):
            raise level
        return level


def test_memory_guard_moves_caps_inside_generation(pair_factory):
    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    N, W, C = PressureLevel.NORMAL, PressureLevel.WARNING, PressureLevel.CRITICAL
    source = FakeSource([N, W, C, RuntimeError("sysctl failed"), W, N, N, N] * 4)
    logs = []
    settings = SchedulerSettings(warmup_steps=100, n_draft_min=1, interval_ms=1e-6)
    guard = MemoryGuard(
        source,
        n_min=1,
        n_max=8,
        interval_ms=1e-6,
        log=logs.append,
        clear_cache=lambda: None,
    )
    policy = SchedulerPolicy(
        None, curve=StepRateCurve.linear(1.0, 0.1), settings=settings, guard=guard
    )
    tokens = run(target, drafter, PROMPTS[0], policy, 64)
    assert tokens == target_greedy(model, PROMPTS[0], 64)
    caps = [r.cap for r in policy.telemetry.recent]
    # warm-up verifies the whole cap, so admitted == cap follows the guard
    assert caps[:6] == [8, 4, 1, 8, 4, 8], caps
    assert len(logs) == 1 and "critical memory pressure" in logs[0]


# --- calibration CLI, profile cache, policy resolution ---------------------------


def resolve(model, drafter, **arguments):
    settings = build_settings(drafter.block_size, **arguments)
    return resolve_policy(model, drafter, settings)


def _private_pair(pair_factory, tmp_path, **fields):
    *_, target_dir, drafter_dir, spec = pair_factory(**fields)
    shutil.copytree(target_dir, tmp_path / "target")
    shutil.copytree(drafter_dir, tmp_path / "drafter")
    return tmp_path / "target", tmp_path / "drafter"


def test_calibration_rounds_spread_over_prompts(pair_factory):
    """Every prompt gives its share of the rounds, and the figures come from
    prompts the temperatures were not fitted on."""
    model, _, drafter, *_ = pair_factory(block_size=4)
    prompts = [*PROMPTS, [7, 8, 9], [3, 3, 4, 5], [30, 2, 8]]
    records, groups = collect_records(model, drafter, prompts, 60, max_tokens=96)
    assert len(records) == len(groups) == 60
    assert sorted(set(groups)) == list(range(6))
    assert max(groups.count(i) for i in range(6)) <= 10
    result = fit_records(records, groups, drafter.block_size)
    assert result.n_rounds == 60
    # The shipped parameters are fitted on every round ...
    z, survived, valid = records_to_arrays(records, drafter.block_size)
    tops = records_per_position(records, "top_logprobs", drafter.block_size)
    fitted = fit_sts_offset(z, tops, survived, valid=valid)
    assert np.allclose(result.temperatures, fitted.temperatures)
    assert result.copy_weights == []  # this drafter does not copy
    # ... and each round is scored by the fit on the other folds' prompts.
    folds = np.array(groups) % 3
    scored = np.zeros_like(z)
    for fold in range(3):
        held = folds == fold
        other = fit_sts_offset(
            z[~held], tops[~held], survived[~held], valid=valid[~held]
        )
        scored[held] = apply_sts(z[held], tops=tops[held], **other._asdict())[1]
    m = valid[:, 0]
    labels = prefix_labels(survived)[m, 0]
    assert result.ece_after[0] == expected_calibration_error(scored[m, 0], labels)
    in_sample = apply_sts(z, tops=tops, **fitted._asdict())[1]
    assert result.ece_after[0] != expected_calibration_error(in_sample[m, 0], labels)
    few = fit_records(records[:30], groups[:30], drafter.block_size)
    assert few.n_rounds == 30  # too few rounds to cross-validate: in sample


def test_calibrate_cli_end_to_end(pair_factory, tmp_path, capsys):
    target_dir, drafter_dir = _private_pair(pair_factory, tmp_path, block_size=8)
    model, tokenizer, drafter = load(target_dir, drafter_dir)
    # No DSpark argument: the adaptive policy, on running estimates and the
    # pair's cost profile (measured once, cached; this drafter does not copy,
    # so its rounds verify up to its block of 8).
    resolved = resolve(model, drafter)
    assert resolved.mode == "adaptive" and resolved.note is None
    assert resolved.policy.calibration is None
    measured = resolved.policy.profile
    assert measured.batch_sizes == list(range(1, 10))
    assert resolved.profile_path is not None
    assert resolve(model, drafter, confidence_threshold=0.5).mode == "threshold"
    assert resolve(model, drafter, num_draft=4).mode == "off"

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("t1 t2 t3\nt20 t4 t11 t9\nt13 t5 t5 t21 t2 t17\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_dspark.calibrate",
            "--model",
            str(target_dir),
            "--draft-model",
            str(drafter_dir),
            "--prompts",
            str(prompts),
            "--rounds",
            "80",
            "--max-tokens",
            "48",
            "--temp",
            "1.0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ECE raw" in proc.stdout and "AUC cal" in proc.stdout
    written = drafter_dir / CALIBRATION_FILE
    data = json.loads(written.read_text())
    assert len(data["temperatures"]) == 8
    assert len(data["top_weights"]) == len(data["offsets"]) == 8
    has_plot = importlib.util.find_spec("matplotlib") is not None
    assert (written.with_suffix(".png")).exists() == has_plot

    model, tokenizer, drafter = load(target_dir, drafter_dir)
    found = find_calibration(model, drafter)
    assert found is not None and found[1] == written
    # The default uses the calibration, and the profile it cached.
    resolved = resolve(model, drafter)
    assert resolved.mode == "adaptive"
    assert resolved.policy.profile.steps_per_second == measured.steps_per_second
    assert resolved.policy.calibration.temperatures == data["temperatures"]
    resolved = resolve(model, drafter, scheduler="auto")
    assert resolved.mode == "auto" and resolved.note is None

    # Unwritable / unknown drafter directory: the user cache, keyed by the pair.
    drafter.source_path = tmp_path / "missing"
    assert default_output(model, drafter) == cached_calibration_path(model, drafter)

    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_dspark.generate",
            "--model",
            str(target_dir),
            "--draft-model",
            str(drafter_dir),
            "--dspark-scheduler",
            "sometimes",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: --dspark-scheduler must be")
        and "Traceback" not in bad.stderr
    )


def test_profile_cache(pair_factory, tmp_path, caplog):
    model, _, drafter, *_ = pair_factory(block_size=8)
    assert load_profile(model, drafter) is None
    with caplog.at_level("INFO", logger="mlx_dspark"):
        curve = get_profile(model, drafter, contexts=(16, 32), repeats=1)
    path = profile_path(profile_key(model, drafter))
    assert [r.getMessage() for r in caplog.records] == [
        f"Measuring this pair's cost profile on this machine into {path}."
    ]
    caplog.clear()
    assert curve.batch_sizes == list(range(1, 10))
    assert curve.draft_seconds > 0 and all(s > 0 for s in curve.steps_per_second)
    key = profile_key(model, drafter)
    assert set(key) >= {"device", "target", "quantization", "drafter", "mlx"}
    assert profile_path(key).is_file()
    with caplog.at_level("INFO", logger="mlx_dspark"):
        again = get_profile(model, drafter, contexts=(16,), repeats=1)
    assert again.steps_per_second == curve.steps_per_second  # cached, not measured
    assert not caplog.records  # a cached profile is read without a word
    fresh = get_profile(model, drafter, "refresh", contexts=(16,), repeats=1)
    assert fresh.meta["contexts"] == [16]
    assert load_profile(model, drafter).meta["contexts"] == [16]
    # A different drafter is a different key.
    other = load_drafter(pair_factory(block_size=8)[4], model)
    other.fc.weight = other.fc.weight * 1.5
    assert profile_key(model, other)["drafter"] != key["drafter"]
    assert load_profile(model, other) is None


def test_an_unwritable_cache_says_the_profile_is_measured_again(
    pair_factory, tmp_path, monkeypatch, caplog
):
    model, _, drafter, *_ = pair_factory(block_size=8)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(blocked))
    with caplog.at_level("INFO", logger="mlx_dspark"):
        curve = get_profile(model, drafter, contexts=(16,), repeats=1)
    assert curve.batch_sizes == list(range(1, 10))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"Could not write the cost profile to "
        f"{profile_path(profile_key(model, drafter))}: each new process measures it "
        "again (MLX_DSPARK_CACHE names a writable cache directory)."
    ]
    assert blocked.read_text() == ""


def test_default_profile_reaches_copied_rounds(pair_factory, tmp_path, caplog):
    """With a drafter that copies, the default policy's profile is measured as
    far as its longest copied round (the cost of verifying 9..16 tokens is not
    a line on every machine); a cached profile that stops at the block is
    measured again, and a later generation reuses the earlier one's."""
    target_dir, drafter_dir = _private_pair(pair_factory, tmp_path, block_size=8)
    model, _, drafter = load(target_dir, drafter_dir)
    block = get_profile(model, drafter, contexts=(16,), repeats=1)
    assert block.batch_sizes == list(range(1, 10))
    assert resolve(model, drafter).policy.profile.batch_sizes == block.batch_sizes
    drafter.config = dataclasses.replace(drafter.config, context_copy_bias=10.0)
    drafter.policy_memory = None
    settings = build_settings(drafter.block_size)
    assert settings.copy_draft == 15
    with caplog.at_level("INFO", logger="mlx_dspark"):
        resolved = resolve(model, drafter)
    assert [r.getMessage() for r in caplog.records] == [
        f"Measuring this pair's cost profile on this machine into "
        f"{profile_path(profile_key(model, drafter))}."
    ]
    caplog.clear()
    assert resolved.policy.profile.batch_sizes == list(range(1, 17))
    assert load_profile(model, drafter, 15) is not None
    assert load_profile(model, drafter, 16) is None
    # The auto scheduler takes the longer profile as it is.
    with caplog.at_level("INFO", logger="mlx_dspark"):
        auto = resolve(model, drafter, scheduler="auto")
        profile_path(profile_key(model, drafter)).unlink()
        again = resolve(model, drafter)
    assert not caplog.records
    assert auto.policy.curve.batch_sizes == list(range(1, 17))
    assert again.policy.profile is resolved.policy.profile


def test_default_scheduler_is_adaptive_and_quiet(pair_factory, capsys):
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    responses = list(stream_generate(model, tokenizer, drafter, [1, 2], max_tokens=8))
    assert capsys.readouterr().err == ""
    assert responses[-1].telemetry.n_rounds == len(responses[-1].stats.rounds)
    with pytest.raises(Exception, match="scheduler must be"):
        list(stream_generate(model, tokenizer, drafter, [1], scheduler="on"))
    policy = ThresholdPolicy()
    assert policy.draft_length  # the plain policy still works without hooks
