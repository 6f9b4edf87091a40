"""mlx_dspark.generate is a superset of mlx_lm.generate: every flag is accepted,
honoured ones give mlx-lm's output, refused ones say why in one sentence."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import mlx_dspark  # noqa: F401  (loads OpenBLAS before mlx)
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair


def _run(module_args, args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", *module_args, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )


def ours(*args, stdin=None):
    return _run(["mlx_dspark.generate"], args, stdin)


def mlx_lm(*args, stdin=None):
    return _run(["mlx_lm", "generate"], args, stdin)


def text_of(result):
    assert result.returncode == 0, result.stderr
    return result.stdout


def refused(result, flag):
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert flag in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


def make_lora_adapter(target, directory):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(target))
    lora = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(0)
    weights = {
        name: 0.5 * mx.random.normal(value.shape)
        for name, value in tree_flatten(model.parameters())
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    directory.mkdir()
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("superset")
    target, drafter = build_structured_pair(root / "pair")
    other, _ = build_structured_pair(root / "other", PairSpec(seed=1))
    chat = root / "chat"
    shutil.copytree(target, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}t9 {% endif %}"
    )
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    adapter = make_lora_adapter(target, root / "adapter")
    return {
        "target": str(target),
        "drafter": str(drafter),
        "other": str(other),
        "chat": str(chat),
        "adapter": str(adapter),
        "root": root,
    }


def test_every_mlx_lm_flag_is_accepted_and_documented():
    from mlx_dspark.cli.generate import _mlx_lm_generate, setup_arg_parser

    theirs = set(_mlx_lm_generate().setup_arg_parser()._option_string_actions)
    mine = set(setup_arg_parser()._option_string_actions)
    assert theirs <= mine
    assert {"--dspark-n-draft", "--dspark-tree", "--num-draft-tokens"} <= mine
    # Every flag of the installed mlx-lm is handled, none refused as unknown.
    from mlx_dspark.cli.generate import MLX_LM_FLAGS

    their_dests = {a.dest for a in _mlx_lm_generate().setup_arg_parser()._actions}
    assert their_dests - {"help"} <= set(MLX_LM_FLAGS)
    their_help = text_of(mlx_lm("--help"))
    our_help = text_of(ours("--help"))
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", their_help))
    assert len(flags) >= 30
    assert flags <= set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", our_help))
    assert "DSpark:" in our_help


def test_a_flag_of_a_newer_mlx_lm_is_refused_not_ignored():
    from mlx_dspark.cli.generate import refuse_unknown, setup_arg_parser
    from mlx_dspark.errors import DSparkError

    parser = setup_arg_parser()
    refuse_unknown(parser, {"model", "temp", "dspark_tree"})
    parser.add_argument("--future-flag", type=int)
    refuse_unknown(parser, {"model"})
    with pytest.raises(DSparkError, match="--future-flag"):
        refuse_unknown(parser, {"model", "future_flag"})


def test_greedy_dspark_output_is_mlx_lm_output(setup):
    t, d = setup["target"], setup["drafter"]
    args = ["--model", t, "-p", "t1 t2 t3", "-m", "24", "--verbose", "false"]
    expected = text_of(mlx_lm(*args))
    assert len(expected.split()) == 24
    assert text_of(ours(*args, "--draft-model", d)) == expected
    # With no draft model the command is mlx-lm's own generate.
    assert text_of(ours(*args)) == expected


def test_verbose_output_follows_mlx_lm_format(setup):
    t, d = setup["target"], setup["drafter"]
    out = text_of(ours("--model", t, "--draft-model", d, "-p", "t1", "-m", "10"))
    lines = out.splitlines()
    assert lines[0] == "=" * 10 and lines[2] == "=" * 10
    assert lines[3].startswith("Prompt: 1 tokens, ")
    assert lines[4].startswith("Generation: 10 tokens, ")
    assert lines[-1].startswith("Peak memory: ")
    assert any(line.startswith("Mean accepted length:") for line in lines)


def test_num_draft_tokens_is_an_alias_of_dspark_n_draft(setup):
    from mlx_dspark.cli.generate import _num_draft, parse_args

    t, d = setup["target"], setup["drafter"]
    base = ["--model", t, "--draft-model", d, "-p", "t1 t2", "-m", "30"]
    alias = text_of(ours(*base, "--num-draft-tokens", "2"))
    flag = text_of(ours(*base, "--dspark-n-draft", "2"))

    def acceptance(out):
        return next(x for x in out.splitlines() if x.startswith("Acceptance by"))

    # At most two drafts per round: two acceptance positions, not the block's 7.
    assert len(acceptance(alias).split()) == 3 + 2
    assert acceptance(alias) == acceptance(flag)
    # mlx-lm's default of 3 is not taken as an explicit --dspark-n-draft.
    args, explicit = parse_args([])
    assert args.num_draft_tokens == 3 and _num_draft(args, explicit) is None
    args, explicit = parse_args(["--num-draft-tokens", "3"])
    assert _num_draft(args, explicit) == 3
    refused(ours(*base, "--num-draft-tokens", "9"), "--num-draft-tokens")
    refused(
        ours(*base, "--num-draft-tokens", "2", "--dspark-n-draft", "3"),
        "--num-draft-tokens",
    )


@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_ordinary_draft_model_runs_mlx_lm_speculative_decoding(setup, temp):
    t = setup["target"]
    for draft in (t, setup["other"]):
        args = ["--model", t, "--draft-model", draft, "-p", "t3 t4", "-m", "20"]
        args += ["--temp", temp, "--seed", "5", "--num-draft-tokens", "2"]
        args += ["--verbose", "false"]
        expected = text_of(mlx_lm(*args))
        assert text_of(ours(*args)) == expected
    refused(
        ours("--model", t, "--draft-model", t, "--dspark-tree", "4"), "--dspark-tree"
    )


def test_adapter_path_applies_lora_to_the_target(setup):
    t, d, adapter = setup["target"], setup["drafter"], setup["adapter"]
    args = ["--model", t, "-p", "t1 t2 t3", "-m", "20", "--verbose", "false"]
    plain = text_of(mlx_lm(*args))
    expected = text_of(mlx_lm(*args, "--adapter-path", adapter))
    assert expected != plain
    assert text_of(ours(*args, "--draft-model", d, "--adapter-path", adapter)) == (
        expected
    )
    assert text_of(ours(*args, "--adapter-path", adapter)) == expected
    missing = ours(*args, "--adapter-path", str(setup["root"] / "none"))
    refused(missing, "adapter path")


def test_extra_eos_token_stops_early(setup):
    t, d = setup["target"], setup["drafter"]
    args = ["--model", t, "-p", "t1 t2 t3", "-m", "20", "--verbose", "false"]
    full = text_of(ours(*args, "--draft-model", d)).split()
    stop = full[3]
    args += ["--extra-eos-token", stop]
    expected = text_of(mlx_lm(*args))
    assert expected.split() == full[: full.index(stop)]
    assert text_of(ours(*args, "--draft-model", d)) == expected


def test_prefill_response_system_prompt_and_chat_template(setup):
    chat, d = setup["chat"], setup["drafter"]
    args = ["--model", chat, "-p", "t1 t2", "-m", "16", "--verbose", "false"]
    for extra in ([], ["--prefill-response", "t5 t6"], ["--system-prompt", "t7"]):
        expected = text_of(mlx_lm(*args, *extra))
        # mlx-lm's output does not change with them either.
    assert text_of(mlx_lm(*args, *extra)) == expected
    assert text_of(ours(*args, "--draft-model", d, *extra)) == expected
    assert text_of(mlx_lm(*args, "--prefill-response", "t5 t6")) != text_of(
        mlx_lm(*args)
    )


def test_flags_that_do_not_change_the_output_are_accepted(setup):
    t, d = setup["target"], setup["drafter"]
    args = ["--model", t, "-p", "t1 t2 t3 t4 t5", "-m", "20", "--verbose", "false"]
    expected = text_of(mlx_lm(*args))
    extra = [
        "--max-kv-size",
        "64",
        "--kv-bits",
        "4",
        "--kv-group-size",
        "32",
        "--prefill-step-size",
        "2",
        "--min-tokens-to-keep",
        "3",
        "--xtc-threshold",
        "0.2",
        "--xtc-probability",
        "0.5",
        "--trust-remote-code",
        "--use-default-chat-template",
        "--quantize-activations",
    ]
    # mlx-lm's output does not change with them either.
    assert text_of(mlx_lm(*args, *extra)) == expected
    assert text_of(ours(*args, "--draft-model", d, *extra)) == expected


def test_prompt_cache_file_without_a_dspark_drafter(setup):
    t, d = setup["target"], setup["drafter"]
    cache = str(setup["root"] / "prompt.safetensors")
    made = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", t]
        + ["--prompt", "t1 t2 t3", "--prompt-cache-file", cache],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    args = ["--prompt-cache-file", cache, "-p", "t4", "-m", "12", "--verbose", "false"]
    expected = text_of(mlx_lm(*args))
    assert text_of(ours(*args)) == expected
    refused(ours(*args, "--model", t, "--draft-model", d), "--prompt-cache-file")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--image", "a.png"], "--image"),
        (["--max-kv-size", "20"], "--max-kv-size"),
        (["--kv-bits", "4", "--quantized-kv-start", "50"], "--kv-bits"),
        (["--max-tokens", "-1", "--max-kv-size", "4096"], "--max-kv-size"),
        (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
        (["--prefill-step-size", "0"], "--prefill-step-size"),
        (["--xtc-probability", "2"], "--xtc-probability"),
        (["--kv-bits", "7"], "--kv-bits"),
        (["--dspark-scheduler", "sometimes"], "--dspark-scheduler"),
        (
            ["--dspark-confidence-threshold", "0.5", "--dspark-scheduler", "off"],
            "--dspark-scheduler",
        ),
        (["--max-tokens", "x"], "--max-tokens"),
    ],
)
def test_refusals_are_one_sentence(setup, args, flag):
    t, d = setup["target"], setup["drafter"]
    refused(ours("--model", t, "--draft-model", d, "-p", "t1", *args), flag)


def test_refusals_without_a_dspark_drafter(setup):
    t = setup["target"]
    refused(ours("--model", t, "--dspark-tree", "3"), "--dspark-tree")
    refused(ours("--model", t, "--dspark-n-draft", "3"), "--dspark-n-draft")
    refused(ours("--model", t, "--image", "a.png"), "--image a.png does not exist")
    image = setup["root"] / "a.png"
    image.write_bytes(b"")
    line = refused(ours("--model", t, "--image", str(image)), "--image")
    assert "does not take images" in line
    refused(ours("--model", t, "--draft-model", t, "--image", "a.png"), "--image")


def test_mismatched_models_are_one_sentence(setup):
    t, d = setup["target"], setup["drafter"]
    other_vocab, _ = build_structured_pair(
        setup["root"] / "v40", PairSpec(vocab_size=40)
    )
    line = refused(ours("--model", t, "--draft-model", str(other_vocab)), "tokenizer")
    assert "--draft-model" in line
    line = refused(ours("--model", str(other_vocab), "--draft-model", d), "vocabulary")
    missing = ours("--model", t, "--draft-model", str(setup["root"] / "none"))
    refused(missing, "does not exist")
    # A vLLM speculators DSpark checkpoint is a drafter, not an mlx-lm model.
    speculators = setup["root"] / "speculators"
    shutil.copytree(d, speculators)
    config = json.loads((speculators / "config.json").read_text())
    config = {"speculators_model_type": "dspark", **config, "architectures": []}
    (speculators / "config.json").write_text(json.dumps(config))
    line = refused(ours("--model", t, "--draft-model", str(speculators)), "convert")
    assert "speculators" in line


def test_min_tokens_to_keep_matches_mlx_lm_min_p():
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p

    from mlx_dspark.sampling.processing import SamplingParams, log_probs

    mx.random.seed(1)
    logits = 3 * mx.random.normal((4, 50))
    for keep in (1, 5):
        params = SamplingParams(1.0, 1.0, 0, 0.3, keep)
        ours_kept = mx.isfinite(log_probs(logits, params))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        theirs_kept = mx.isfinite(apply_min_p(logprobs, 0.3, keep))
        assert mx.array_equal(ours_kept, theirs_kept).item()
        assert (ours_kept.sum(axis=-1) >= keep).all().item()


def test_xtc_matches_mlx_lm_apply_xtc():
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_xtc

    from mlx_dspark.sampling.processing import SamplingParams, log_probs

    mx.random.seed(2)
    logits = 2 * mx.random.normal((6, 40))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    special = (0, 5)

    def tempered(x, temp):
        return mx.softmax(x / temp, axis=-1)

    for temp in (0.7, 1.0):
        plain = tempered(logprobs, temp)
        # mlx-lm with its coin always saying "apply": the cut distribution.
        cut = tempered(apply_xtc(logprobs, 1.0, 0.1, list(special)), temp)
        assert (mx.isinf(mx.log(cut)).sum() > 0).item()
        for chance in (0.0, 0.4, 1.0):
            params = SamplingParams(temp, 1.0, 0, 0.0, 1, chance, 0.1, special)
            ours_probs = mx.exp(log_probs(logits, params))
            expected = (1 - chance) * plain + chance * cut
            assert mx.allclose(ours_probs, expected, atol=1e-6).item()


def test_xtc_sampling_with_a_drafter_is_exact(pair_factory):
    from test_sampling import (
        SEEDS,
        chi_square,
        chi_square_critical,
        exact_joint,
        sample_first_three,
    )

    from mlx_dspark.sampling.processing import SamplingParams

    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = SamplingParams(1.0, xtc_probability=0.5, xtc_threshold=0.05)
    joint = exact_joint(model, params)
    plain = exact_joint(model, SamplingParams(1.0))
    assert abs(sum(joint.values()) - 1.0) < 1e-4
    assert sum(abs(joint.get(k, 0) - plain.get(k, 0)) for k in plain) > 0.1
    samples, _ = sample_first_three(model, drafter, params)
    stat, dof = chi_square(samples, joint, SEEDS)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    # The test can fail: the same samples do not fit plain sampling.
    stat, dof = chi_square(samples, plain, SEEDS)
    assert stat > chi_square_critical(dof)


def test_xtc_flags_run_with_a_dspark_drafter(setup):
    t, d = setup["target"], setup["drafter"]
    args = ["--model", t, "--draft-model", d, "-p", "t1 t2", "-m", "20"]
    args += ["--temp", "1", "--seed", "3", "--verbose", "false"]
    plain = text_of(ours(*args))
    xtc = ["--xtc-probability", "1", "--xtc-threshold", "0.05"]
    first, second = text_of(ours(*args, *xtc)), text_of(ours(*args, *xtc))
    assert first == second != plain
