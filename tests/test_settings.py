"""The speculation setup is decided once: defaults, explicit beats the
environment, one-sentence errors, and the same setup for the same inputs in
stream_generate, calibration and the benchmark."""

import sys

import pytest

from mlx_dspark import stream_generate
from mlx_dspark.benchmark import Pair, Settings, select_variants
from mlx_dspark.decoding.modes import ChainMode, TreeMode
from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.calibrate import calibration_settings
from mlx_dspark.policy.scheduler import SchedulerSettings
from mlx_dspark.policy.settings import COPY_DRAFTS, build_settings

THRESHOLD_VAR = "DSPARK_CONFIDENCE_THRESHOLD"


@pytest.fixture(autouse=True)
def _clean_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    for name in (THRESHOLD_VAR, "DSPARK_SCHEDULER_ENABLED", "DSPARK_N_DRAFT_MAX"):
        monkeypatch.delenv(name, raising=False)


def test_defaults():
    s = build_settings(7, env={})
    assert (s.num_draft, s.policy, s.tree_budget, s.profile) == (
        7,
        "adaptive",
        0,
        "auto",
    )
    assert s.scheduler == SchedulerSettings() and s.notes == ()
    assert isinstance(s.make_mode(), ChainMode)
    # An explicit draft count means always that many; a threshold cuts.
    assert build_settings(7, 3, env={}).policy == "off"
    assert build_settings(7, 3, env={}).num_draft == 3
    assert build_settings(7, confidence_threshold=0.5, env={}).policy == "threshold"
    tree = build_settings(7, tree_budget=6, env={}).make_mode()
    assert isinstance(tree, TreeMode) and tree.budget == 6
    # The variable or a profile refresh ask for the calibrated scheduler.
    assert build_settings(7, env={"DSPARK_SCHEDULER_ENABLED": "1"}).policy == "auto"
    assert build_settings(7, profile="refresh", env={}).policy == "auto"
    off = {"DSPARK_SCHEDULER_ENABLED": "0"}
    assert build_settings(7, env=off).policy == "off"
    zero = build_settings(7, 0, env={})
    assert zero.num_draft == 0 and "target alone" in zero.notes[0]
    # Rounds offered a copy verify past the block only under the default
    # policy drafting chains, with no draft count given.
    assert s.copy_draft == COPY_DRAFTS > 7
    assert build_settings(20, env={}).copy_draft == 20
    assert build_settings(7, 7, env={}).copy_draft is None
    assert build_settings(7, scheduler="auto", env={}).copy_draft is None
    assert build_settings(7, tree_budget=6, env={}).copy_draft is None
    assert zero.copy_draft is None
    # The frozen setup cannot change after the decision.
    with pytest.raises(AttributeError):
        zero.num_draft = 3


def test_explicit_arguments_beat_the_environment():
    env = {THRESHOLD_VAR: "0.4"}
    from_env = build_settings(7, env=env)
    assert from_env.policy == "threshold" and from_env.confidence_threshold == 0.4
    assert from_env.notes == ()
    given = build_settings(7, confidence_threshold=0.0, env=env)
    assert given.policy == "adaptive" and given.confidence_threshold == 0.0
    assert given.notes == (
        f"{THRESHOLD_VAR} is ignored: confidence_threshold was given.",
    )
    assert (
        build_settings(7, confidence_threshold=0.7, env=env).confidence_threshold == 0.7
    )
    # A named policy that does not cut at a threshold ignores the variable.
    off = build_settings(7, scheduler="off", env=env)
    assert off.policy == "off" and off.confidence_threshold == 0.0
    assert THRESHOLD_VAR in off.notes[0]
    # Other variables still apply over the caller's knobs.
    knobs = build_settings(7, env={"DSPARK_N_DRAFT_MAX": "3"}).scheduler
    assert knobs.n_draft_max == 3


def test_stream_generate_lets_the_argument_win(pair_factory, monkeypatch):
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    monkeypatch.setenv(THRESHOLD_VAR, "0.9")
    last = list(stream_generate(model, tokenizer, drafter, [1, 2], max_tokens=4))[-1]
    assert last.settings.policy == "threshold"
    assert last.telemetry.policy == "threshold"
    last = list(
        stream_generate(
            model, tokenizer, drafter, [1, 2], max_tokens=4, confidence_threshold=0.0
        )
    )[-1]
    assert last.settings.policy == last.telemetry.policy == "adaptive"
    assert last.settings.confidence_threshold == 0.0
    assert THRESHOLD_VAR in last.settings.notes[0]


@pytest.mark.parametrize(
    "arguments, name",
    [
        ({"num_draft": 8}, "num_draft"),
        ({"num_draft": -1}, "num_draft"),
        ({"confidence_threshold": 1.5}, "confidence_threshold"),
        ({"confidence_threshold": -0.1}, "confidence_threshold"),
        ({"scheduler": "on"}, "scheduler"),
        ({"profile": "never"}, "profile"),
        ({"tree_budget": -1}, "tree_budget"),
        ({"confidence_threshold": 0.5, "scheduler": "off"}, "confidence_threshold"),
    ],
)
def test_each_invalid_value_is_one_sentence(arguments, name):
    with pytest.raises(DSparkError) as info:
        build_settings(7, env={}, **arguments)
    message = str(info.value)
    assert message.startswith(f"{name} ") and message.endswith(".")
    assert "\n" not in message and message.count(". ") == 0
    flag = f"--{name.replace('_', '-')}"
    with pytest.raises(DSparkError, match=f"^{flag} "):
        build_settings(7, env={}, names={name: flag}, **arguments)


def test_a_negative_draft_count_is_refused_without_the_block_size():
    # The command line checks flags before loading the drafter, with an
    # unknown (unbounded) block size: that number must not show.
    for block in (7, sys.maxsize):
        with pytest.raises(DSparkError) as info:
            build_settings(block, -3, env={}, names={"num_draft": "--dspark-n-draft"})
        assert str(info.value) == "--dspark-n-draft must be at least 0, got -3."
    with pytest.raises(DSparkError, match="block size 7, got 8"):
        build_settings(7, 8, env={})


def test_an_invalid_variable_names_itself():
    with pytest.raises(DSparkError, match=f"^{THRESHOLD_VAR}="):
        build_settings(7, env={THRESHOLD_VAR: "high"})


def test_same_inputs_same_settings_everywhere(pair_factory):
    model, tokenizer, drafter, *_ = pair_factory(block_size=6)
    block = drafter.block_size

    def settings_of(**arguments):
        responses = stream_generate(
            model, tokenizer, drafter, [1, 2, 3], max_tokens=6, **arguments
        )
        return list(responses)[-1].settings

    pair = Pair(model, tokenizer, drafter, "small")
    bench = Settings(
        fixed_n=[2, block], thresholds=[0.5], mlx_lm_num_draft=3, tree_budgets=[4]
    )
    names = ["fixed", "threshold", "default", "tree"]
    variants = {v.name: v.settings for v in select_variants(pair, bench, names)}
    expected = {
        "dspark-fixed-2": {
            "num_draft": 2,
            "confidence_threshold": 0.0,
            "scheduler": "off",
        },
        f"dspark-fixed-{block}": {
            "num_draft": block,
            "confidence_threshold": 0.0,
            "scheduler": "off",
        },
        "dspark-threshold-0.5": {"confidence_threshold": 0.5, "scheduler": "threshold"},
        "dspark-default": {},
        "dspark-tree-4": {
            "confidence_threshold": 0.0,
            "scheduler": "off",
            "tree_budget": 4,
        },
    }
    assert set(variants) == {"target", *expected}
    for name, arguments in expected.items():
        built = build_settings(block, **arguments)
        assert variants[name] == built, name
        assert settings_of(**arguments) == built, name
    # Calibration verifies whole blocks: the fixed full-block setup.
    assert calibration_settings(drafter) == variants[f"dspark-fixed-{block}"]
    assert calibration_settings(drafter).num_draft == block


def test_prebuilt_settings_give_the_same_tokens(pair_factory):
    model, tokenizer, drafter, *_ = pair_factory(block_size=6)
    block = drafter.block_size
    arguments = {"num_draft": block, "scheduler": "off"}
    settings = build_settings(block, **arguments)

    def tokens(**kwargs):
        responses = stream_generate(
            model, tokenizer, drafter, [4, 5, 6], max_tokens=24, seed=0, **kwargs
        )
        responses = list(responses)
        return [r.token for r in responses], responses[-1].stats

    by_arguments, stats_a = tokens(**arguments)
    by_settings, stats_s = tokens(settings=settings)
    assert by_arguments == by_settings
    assert [r.accepted for r in stats_a.rounds] == [r.accepted for r in stats_s.rounds]
    with pytest.raises(DSparkError, match="settings or num_draft, not both"):
        tokens(settings=settings, num_draft=2)


def test_the_generate_flag_beats_the_environment(monkeypatch):
    from mlx_dspark.cli.generate import _speculation, parse_args

    monkeypatch.setenv(THRESHOLD_VAR, "0.9")
    args, explicit = parse_args(["--dspark-confidence-threshold", "0"])
    flag = _speculation(args, explicit, 7)
    assert flag.policy == "adaptive" and flag.confidence_threshold == 0.0
    assert flag.notes == (
        f"{THRESHOLD_VAR} is ignored: --dspark-confidence-threshold was given.",
    )
    args, explicit = parse_args([])
    assert _speculation(args, explicit, 7).confidence_threshold == 0.9
    args, explicit = parse_args(["--num-draft-tokens", "9"])
    with pytest.raises(DSparkError, match="^--num-draft-tokens must be between 0"):
        _speculation(args, explicit, 7)
