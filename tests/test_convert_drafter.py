"""Drafter conversion: DeepSpec / speculators -> MLX (2-8 bit) -> DeepSpec."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_dspark.convert.__main__ import main as convert_main
from mlx_dspark.convert.drafter import DSPARK_KEYS, convert_drafter, plan_drafter
from test_greedy import target_greedy
from test_sampling import (
    chi_square,
    chi_square_critical,
    exact_joint,
    sample_first_three,
)

from mlx_dspark import stream_generate
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.checkpoints.weights import draft_to_target_ids
from mlx_dspark.decoding.loop import GenerationStats
from mlx_dspark.errors import DSparkError
from mlx_dspark.loading import load
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.sampling.processing import SamplingParams

# Every quantized matrix's input axis is a multiple of 128; Markov rank 128.
DIMS = dict(hidden_size=128, head_dim=32, intermediate_size=256, markov_rank=128)
PROMPTS = [[1, 2, 3], [20, 4, 11, 9], [13, 5, 5, 21, 2, 17]]
MAX_TOKENS = 40
# Target tokens left out of the reduced draft vocabulary.
DROPPED = (3, 9, 17, 22)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("convpair")
    target_dir, drafter_dir = build_structured_pair(
        directory, PairSpec(**DIMS), mx.bfloat16
    )
    model, tokenizer, _ = load(target_dir)
    expected = [target_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return target_dir, drafter_dir, model, tokenizer, expected


def dspark_greedy(model, tokenizer, drafter, prompts=PROMPTS):
    outputs, rounds = [], []
    for prompt in prompts:
        responses = list(
            stream_generate(
                model,
                tokenizer,
                drafter,
                prompt,
                max_tokens=MAX_TOKENS,
                num_draft=drafter.block_size,  # fixed: rounds comparable across runs
            )
        )
        outputs.append([r.token for r in responses])
        rounds.append([r.accepted for r in responses[-1].stats.rounds])
    return outputs, rounds


def tensors(directory: Path) -> dict[str, mx.array]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


def write_sharded(src: Path, dst: Path, parts: int = 3) -> None:
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        shard = {k: weights[k] for k in names[i::parts]}
        mx.save_safetensors(str(dst / file), shard)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def write_speculators(
    src: Path, dst: Path, keep: list[int] | None = None, w1_by_draft_id=False
) -> None:
    """A vLLM speculators ``dspark`` checkpoint holding the same drafter,
    optionally with a reduced draft vocabulary ``keep`` (target ids)."""
    config = json.loads((src / "config.json").read_text())
    weights = dict(mx.load(str(src / "model.safetensors")))
    layer = {k: v for k, v in config.items() if k not in DSPARK_KEYS}
    vocab = config["vocab_size"]
    spec_config = {
        "speculators_model_type": "dspark",
        "architectures": ["DSparkSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": vocab if keep is None else len(keep),
        "block_size": config["block_size"],
        "num_anchors": 256,
        "aux_hidden_state_layer_ids": [i + 1 for i in config["target_layer_ids"]],
        "mask_token_id": config["mask_token_id"],
        "markov_rank": config["markov_rank"],
        "markov_head_type": config["markov_head_type"],
        "enable_confidence_head": True,
        "confidence_head_with_markov": config["confidence_head_with_markov"],
        "sample_from_anchor": True,
        "speculators_config": {
            "algorithm": "dspark",
            "verifier": {"name_or_path": "some/target", "architectures": []},
        },
    }
    weights.pop("embed_tokens.weight")  # speculators never saves it
    weights["verifier_norm.weight"] = mx.ones((config["hidden_size"],))
    if keep is not None:
        ids = mx.array(keep)
        weights["lm_head.weight"] = weights["lm_head.weight"][ids]
        w2 = "markov_head.markov_w2.weight"
        weights[w2] = weights[w2][ids]
        if w1_by_draft_id:
            w1 = "markov_head.markov_w1.weight"
            weights[w1] = weights[w1][ids]
        weights["d2t"] = (ids - mx.arange(len(keep))).astype(mx.int64)
        t2d = np.zeros(vocab, bool)
        t2d[keep] = True
        weights["t2d"] = mx.array(t2d)
    weights["verifier_lm_head.weight"] = weights["lm_head.weight"]
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(spec_config))
    mx.save_safetensors(str(dst / "model.safetensors"), weights)


def reduced_ids(vocab: int) -> list[int]:
    return [i for i in range(vocab) if i not in DROPPED]


# ------------------------------------------------------------------ DeepSpec


@pytest.mark.parametrize(
    "bits, group_size",
    [(2, 64), (3, 64), (4, 64), (6, 64), (8, 64), (4, 32), (4, 128)],
)
def test_quantized_drafts_load_and_stay_lossless(pair, tmp_path, bits, group_size):
    target_dir, drafter_dir, model, tokenizer, expected = pair
    out = tmp_path / "q"
    plan = convert_drafter(
        drafter_dir,
        out,
        quantize=True,
        bits=bits,
        group_size=group_size,
        target=target_dir,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": group_size, "bits": bits}
    provenance = config["mlx_dspark_conversion"]
    assert list(provenance["files"]) == ["model.safetensors"]
    assert len(provenance["files"]["model.safetensors"]) == 64
    assert (out / "README.md").is_file()
    written = tensors(out)
    assert "embed_tokens.weight" not in written and "lm_head.weight" not in written
    assert abs(sum(v.nbytes for v in written.values()) - plan.total_bytes) < 64
    drafter = load_drafter(out, model)
    assert drafter.shares_embeddings
    quantized = {k.removesuffix(".scales") for k in written if k.endswith(".scales")}
    assert quantized == {
        "fc",
        "markov_head.markov_w1",
        "markov_head.markov_w2",
        *(f"layers.0.self_attn.{p}_proj" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")),
    }
    up = written["layers.0.mlp.up_proj.weight"]
    assert up.dtype == mx.uint32 and up.shape[-1] * 32 // bits == 128
    assert written["layers.0.mlp.up_proj.scales"].shape[-1] == 128 // group_size
    # On the CPU backend the loaded drafter is dequantized (float weights).
    assert not any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for _, m in drafter.named_modules()
    )
    assert drafter.confidence_head.proj.weight.dtype == mx.bfloat16
    assert drafter.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16
    outputs, _ = dspark_greedy(model, tokenizer, drafter)
    assert outputs == expected


def test_float_conversion_is_exact_and_keeps_every_key(pair, tmp_path):
    target_dir, drafter_dir, model, tokenizer, expected = pair
    convert_drafter(drafter_dir, tmp_path / "f", dtype="float32")
    source = json.loads((drafter_dir / "config.json").read_text())
    config = json.loads((tmp_path / "f" / "config.json").read_text())
    assert all(config[k] == v for k, v in source.items())
    assert "quantization" not in config
    before, after = tensors(drafter_dir), tensors(tmp_path / "f")
    assert set(before) == set(after)  # no --target: embeddings kept
    for name, value in before.items():
        assert after[name].dtype == mx.float32
        assert mx.array_equal(after[name], value.astype(mx.float32)), name
    drafter = load_drafter(tmp_path / "f", model)
    assert drafter.shares_embeddings  # equal copies are shared at load
    assert dspark_greedy(model, tokenizer, drafter)[0] == expected


def test_sharded_input_and_output(pair, tmp_path):
    target_dir, drafter_dir, model, tokenizer, expected = pair
    sharded = tmp_path / "sharded"
    write_sharded(drafter_dir, sharded)
    convert_drafter(drafter_dir, tmp_path / "a", quantize=True)
    convert_drafter(sharded, tmp_path / "b", quantize=True, max_shard_bytes=20_000)
    provenance = json.loads((tmp_path / "b" / "config.json").read_text())[
        "mlx_dspark_conversion"
    ]
    assert len(provenance["files"]) == 3
    shards = sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert set(index["weight_map"]) == set(b) == set(a)
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    _, _, drafter = load(target_dir, tmp_path / "b")
    assert dspark_greedy(model, tokenizer, drafter)[0] == expected


def test_export_round_trip(pair, tmp_path):
    target_dir, drafter_dir, model, tokenizer, expected = pair
    q4, back = tmp_path / "q4", tmp_path / "back"
    convert_drafter(drafter_dir, q4, quantize=True, target=target_dir)
    with pytest.raises(DSparkError, match="pass --target"):
        convert_drafter(q4, back, to="deepspec")
    assert not back.exists()
    convert_drafter(q4, back, to="deepspec", target=target_dir, dtype="float32")
    config = json.loads((back / "config.json").read_text())
    assert "quantization" not in config
    assert config["architectures"] == ["Qwen3DSparkModel"]
    exported = tensors(back)
    assert set(exported) == set(tensors(drafter_dir))  # DeepSpec names, no scales
    target = tensors(target_dir)
    assert mx.array_equal(
        exported["embed_tokens.weight"], target["model.embed_tokens.weight"]
    )
    quantized_outputs, quantized_rounds = dspark_greedy(
        model, tokenizer, load_drafter(q4, model)
    )
    outputs, rounds = dspark_greedy(model, tokenizer, load_drafter(back, model))
    assert outputs == quantized_outputs == expected
    assert rounds == quantized_rounds


# --------------------------------------------------------------- speculators


def test_speculators_full_vocab_matches_deepspec(pair, tmp_path):
    target_dir, drafter_dir, model, tokenizer, expected = pair
    write_speculators(drafter_dir, tmp_path / "spec")
    convert_drafter(drafter_dir, tmp_path / "a", target=target_dir)
    convert_drafter(tmp_path / "spec", tmp_path / "b", target=target_dir)
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert set(a) == set(b)
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    source = json.loads((drafter_dir / "config.json").read_text())
    assert config["target_layer_ids"] == source["target_layer_ids"]
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert "draft_vocab_size" not in config
    assert config["mlx_dspark_conversion"]["source_format"] == "speculators"


@pytest.mark.parametrize("w1_by_draft_id", [False, True], ids=["w1-target", "w1-draft"])
def test_speculators_reduced_vocab_end_to_end(pair, tmp_path, w1_by_draft_id):
    target_dir, drafter_dir, model, tokenizer, expected = pair
    keep = reduced_ids(model.args.vocab_size)
    write_speculators(drafter_dir, tmp_path / "spec", keep, w1_by_draft_id)
    convert_drafter(tmp_path / "spec", tmp_path / "q", quantize=True, target=target_dir)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["draft_vocab_size"] == len(keep)
    written = tensors(tmp_path / "q")
    assert "embed_tokens.weight" not in written  # equals the target's
    assert "lm_head.scales" in written  # kept (reduced vocabulary) and quantized
    assert written["draft_to_target"].tolist() == keep
    assert written["markov_head.markov_w1.scales"].shape[0] == model.args.vocab_size
    drafter = load_drafter(tmp_path / "q", model)
    outputs, rounds = dspark_greedy(model, tokenizer, drafter)
    assert outputs == expected
    accepted = [a for r in rounds for a in r]
    assert np.mean(accepted) > 1.0
    # Drafts never use the tokens outside the draft vocabulary.
    hidden = drafter(drafter.block_tokens(mx.array([5])), 0, None, drafter.make_cache())
    from mlx_dspark.sampling.processing import SamplingParams

    proposal = drafter.propose(hidden, mx.array([5]), 4, SamplingParams(), None)
    assert proposal.logits.shape[-1] == model.args.vocab_size
    assert np.isneginf(
        np.array(proposal.logits[0][:, list(DROPPED)].astype(mx.float32))
    ).all()
    with pytest.raises(DSparkError, match="reduced draft vocabulary"):
        convert_drafter(
            tmp_path / "q", tmp_path / "x", to="deepspec", target=target_dir
        )


def test_reduced_vocab_sampling_is_exact(tmp_path):
    target_dir, drafter_dir = build_structured_pair(
        tmp_path / "pair", PairSpec(sharpness=0.6, block_size=4)
    )
    model, _, _ = load(target_dir)
    keep = reduced_ids(model.args.vocab_size)
    write_speculators(drafter_dir, tmp_path / "spec", keep)
    convert_drafter(tmp_path / "spec", tmp_path / "out", target=target_dir)
    drafter = load_drafter(tmp_path / "out", model)
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(model, params)
    seeds = 1000
    samples, stats = sample_first_three(model, drafter, params, seeds=seeds)
    assert isinstance(stats, GenerationStats)
    stat, dof = chi_square(samples, joint, seeds)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    accepted = [r.accepted for r in stats.rounds]
    assert 0 < np.mean(accepted)


def test_d2t_conventions():
    ids = np.array([0, 2, 5, 6])
    t2d = np.zeros(8, bool)
    t2d[ids] = True
    offset = ids - np.arange(4)
    assert draft_to_target_ids(offset, t2d, 8).tolist() == ids.tolist()
    assert draft_to_target_ids(ids, t2d, 8).tolist() == ids.tolist()
    assert draft_to_target_ids(offset, None, 8).tolist() == ids.tolist()
    with pytest.raises(DSparkError, match="do not agree"):
        draft_to_target_ids(np.array([0, 1, 1, 1]), t2d, 8)
    with pytest.raises(DSparkError, match="distinct"):
        draft_to_target_ids(np.array([9, 9, 9, 9]), None, 8)


# -------------------------------------------------------------------- CLI


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert_main([str(a) for a in args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.err


def test_cli_dry_run_and_convert(pair, tmp_path, capsys):
    target_dir, drafter_dir, *_ = pair
    convert_main(
        [
            "--draft-model",
            str(drafter_dir),
            "--dry-run",
            "-q",
            "--q-bits",
            "3",
            "--target",
            str(target_dir),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    out = capsys.readouterr().out
    assert "3-bit" in out and "left out" in out and "estimated size" in out
    assert not (tmp_path / "o").exists()
    convert_main(
        ["--draft-model", str(drafter_dir), "-q", "--out", str(tmp_path / "o")]
    )
    written = capsys.readouterr().out
    assert "wrote" in written and "MiB of weights from" in written
    assert (tmp_path / "o" / "model.safetensors").is_file()


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced"])
def test_speculators_export_round_trip(pair, tmp_path, reduced):
    target_dir, drafter_dir, model, tokenizer, expected = pair
    source = drafter_dir
    if reduced:
        keep = reduced_ids(model.args.vocab_size)
        write_speculators(drafter_dir, tmp_path / "spec-in", keep)
        source = tmp_path / "source"
        convert_drafter(tmp_path / "spec-in", source, target=target_dir)
    q4, spec, back = tmp_path / "q4", tmp_path / "spec", tmp_path / "back"
    convert_drafter(source, q4, quantize=True, target=target_dir)
    convert_drafter(q4, spec, to="speculators", target=target_dir, dtype="float32")
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    source_config = json.loads((drafter_dir / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [
        i + 1 for i in source_config["target_layer_ids"]
    ]
    assert config["transformer_layer_config"]["hidden_size"] == 128
    exported = tensors(spec)
    assert "embed_tokens.weight" not in exported
    assert "draft_to_target" not in exported and "quantization" not in config
    if reduced:
        assert config["draft_vocab_size"] == len(keep)
        ids = exported["d2t"] + mx.arange(len(keep))
        assert ids.tolist() == keep
        assert np.flatnonzero(np.array(exported["t2d"])).tolist() == keep
    else:
        assert "d2t" not in exported
    convert_drafter(spec, back, quantize=True, target=target_dir)
    outputs, rounds = dspark_greedy(model, tokenizer, load_drafter(back, model))
    q4_outputs, q4_rounds = dspark_greedy(model, tokenizer, load_drafter(q4, model))
    assert outputs == q4_outputs == expected
    assert rounds == q4_rounds


def test_conversion_carries_the_calibration_and_training_record(pair, tmp_path):
    from mlx_dspark.policy.calibration import CalibrationResult

    target_dir, drafter_dir, *_ = pair
    source = tmp_path / "source"
    convert_drafter(drafter_dir, source, quantize=True, bits=4, target=target_dir)
    CalibrationResult([1.5, 2.0], [0.1] * 2, [0.05] * 2, [0.6] * 2, [0.6] * 2, 10).save(
        source / "dspark_calibration.json"
    )
    (source / "training_record.json").write_text(json.dumps({"steps": 3}))
    for to, out in (("mlx", tmp_path / "q3"), ("speculators", tmp_path / "spec")):
        options = {"quantize": True, "bits": 3} if to == "mlx" else {"to": to}
        convert_drafter(source, out, target=target_dir, **options)
        carried = CalibrationResult.load(out / "dspark_calibration.json")
        assert carried.temperatures == [1.5, 2.0]
        assert carried.measured_with == "4-bit weights"
        record = json.loads((out / "training_record.json").read_text())
        assert record == {"steps": 3}


def test_conversion_carries_the_phrase_store(pair, tmp_path):
    from mlx_dspark import load
    from mlx_dspark.proposers.suffix_store import write_phrases

    target_dir, drafter_dir, *_ = pair
    source = tmp_path / "source"
    shutil.copytree(drafter_dir, source)
    write_phrases(source / "phrases.npy", [[1, 2, 3, 4], [5, 6, 7]])
    for options in ({"quantize": True, "bits": 4}, {"to": "deepspec"}):
        out = tmp_path / str(options.get("bits", options.get("to")))
        convert_drafter(source, out, target=target_dir, **options)
        assert (out / "phrases.npy").read_bytes() == (
            source / "phrases.npy"
        ).read_bytes()
        _, _, drafter = load(target_dir, out)
        assert drafter.phrase_store is not None


def _corrupt(drafter_dir: Path, tmp_path: Path, how: str) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(drafter_dir, bad)
    file = bad / "model.safetensors"
    config = json.loads((bad / "config.json").read_text())
    if how == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif how == "garbage":
        file.write_bytes(
            b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"0" * 64
        )
    elif how in ("missing", "shape", "f64"):
        weights = dict(mx.load(str(file)))
        if how == "missing":
            weights.pop("fc.weight")
        elif how == "shape":
            weights["fc.weight"] = weights["fc.weight"][:, :-1]
        else:
            weights["fc.weight"] = weights["fc.weight"].astype(mx.int16)
        mx.save_safetensors(str(file), weights)
    elif how == "pickle":
        file.rename(bad / "pytorch_model.bin")
    elif how == "not-dspark":
        config["architectures"] = ["LlamaForCausalLM"]
    elif how == "gemma":
        config["architectures"] = ["Gemma4DSparkModel"]
    elif how == "eagle3":
        # EAGLE-3 checkpoints go to their own converter, which reads this one's
        # config as broken.
        config = {"speculators_model_type": "eagle3"}
    elif how == "missing-shard":
        shutil.rmtree(bad)
        write_sharded(drafter_dir, bad)
        next(bad.glob("model-00002-*")).unlink()
    elif how == "bad-config":
        (bad / "config.json").write_text("{not json")
        return bad
    (bad / "config.json").write_text(json.dumps(config)) if bad.exists() else None
    return bad


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "truncated or not a valid safetensors"),
        ("garbage", "truncated or not a valid safetensors"),
        ("missing", "missing tensors: fc.weight"),
        ("shape", "has shape"),
        ("f64", "must be bfloat16, float16 or float32"),
        ("pickle", "pytorch_model.bin is not a supported drafter format"),
        ("not-dspark", "Not a DSpark drafter"),
        ("gemma", "Gemma4DSparkModel config is missing"),
        ("eagle3", "speculators config has no transformer_layer_config"),
        ("missing-shard", "is missing"),
        ("bad-config", "not valid JSON"),
    ],
)
def test_cli_refuses_bad_inputs(pair, tmp_path, capsys, how, message):
    _, drafter_dir, *_ = pair
    bad = _corrupt(drafter_dir, tmp_path, how)
    out = tmp_path / "sub" / "out"
    code, err = run_cli(["--draft-model", bad, "-q", "--out", out], capsys)
    assert code == 1
    assert message in err, err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    assert not out.exists() and not out.parent.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--q-bits", "4"], "need -q"),
        (["--dequantize"], "No such option"),
        (["-q", "--to", "deepspec"], "cannot take -q"),
        (["--target", "{other}"], "belongs to another target"),
        (["--target", "{missing}"], "does not exist"),
    ],
)
def test_cli_refuses_bad_options(pair, tmp_path, capsys, extra, message):
    _, drafter_dir, *_ = pair
    other, _ = build_structured_pair(tmp_path / "other", PairSpec())
    extra = [e.format(other=other, missing=tmp_path / "nowhere") for e in extra]
    out = tmp_path / "out"
    code, err = run_cli(["--draft-model", drafter_dir, "--out", out, *extra], capsys)
    assert code == 1 and message in err, err
    assert not out.exists()


def test_cli_refuses_non_empty_out_without_force(pair, tmp_path, capsys):
    _, drafter_dir, *_ = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_cli(["--draft-model", drafter_dir, "--out", out], capsys)
    assert code == 1 and "not empty" in err
    assert (out / "keep.txt").read_text() == "mine"
    convert_main(["--draft-model", str(drafter_dir), "--out", str(out), "--force"])
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_plan_keeps_unquantizable_tensors_float(pair, tmp_path):
    _, _, model, *_ = pair
    target_dir, drafter_dir = build_structured_pair(tmp_path, PairSpec())
    plan = plan_drafter(drafter_dir, quantize=True, group_size=64)
    actions = {t.name: (t.action, t.note) for t in plan.tensors}
    # Rank 31: the Markov head cannot be grouped by 64.
    assert actions["markov_head.markov_w1.weight"][0] == "float"
    assert "not a multiple of 64" in actions["markov_head.markov_w1.weight"][1]
    assert actions["fc.weight"][0] == "quantize"
    convert_drafter(drafter_dir, tmp_path / "q", quantize=True, group_size=64)
    model, tokenizer, drafter = load(target_dir, tmp_path / "q")
    prompt = [1, 2, 3]
    tokens = [
        r.token
        for r in stream_generate(model, tokenizer, drafter, prompt, max_tokens=24)
    ]
    assert tokens == target_greedy(model, prompt, 24)
    names = set(tensors(tmp_path / "q"))
    assert "markov_head.markov_w1.scales" not in names and "fc.scales" in names
