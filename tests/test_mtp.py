"""MTP drafters (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE): parity with mlx-vlm's
drafter, losslessness through the loop, extraction and its refusals.

The checkpoints are tiny originals in Hugging Face's layout
(tests/mtp_checkpoints.py); the targets are mlx-lm conversions of them,
which carry no MTP module, as mlx-community's do."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_dspark.convert.mtp import extract_mtp
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.convert import convert
from mlx_vlm.speculative.drafters import load_drafter as vlm_load_drafter
from mtp_checkpoints import mtp_weights, save_hf_checkpoint
from test_sampling import (
    chi_square,
    chi_square_critical,
    exact_joint,
    sample_first_three,
)
from test_seed import SETTINGS, dspark_tokens, mlx_lm_tokens, served, served_as

import mlx_dspark
from mlx_dspark.checkpoints.mtp import OFFSET_NORMS
from mlx_dspark.cli.convert import main as convert_main
from mlx_dspark.cli.doctor import main as doctor_main
from mlx_dspark.cli.generate import main as generate_main
from mlx_dspark.errors import DSparkError
from mlx_dspark.generation import stream_generate
from mlx_dspark.proposers.base import Round
from mlx_dspark.proposers.mtp import MTPProposer
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.serving import BatchEngine, EngineConfig, GenerationRequest
from mlx_dspark.targets.adapter import TargetAdapter

TYPES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
PROMPT = [3, 14, 15, 9, 2, 6]
DRAFTS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(original dir, float target dir, drafter dir) per model type, built once."""
    root = tmp_path_factory.mktemp("mtp")
    built = {}

    def get(model_type: str, bits: int | None = None):
        key = (model_type, bits)
        if key not in built:
            base = root / model_type
            hf = base / "hf"
            if not hf.exists():
                save_hf_checkpoint(hf, model_type)
            target = base / f"target-{bits}"
            recipe = {"quantize": True, "q_bits": bits, "q_group_size": 32}
            convert(str(hf), str(target), dtype="float32", **(recipe if bits else {}))
            drafter = base / f"mtp-{bits}"
            extract_mtp(hf, drafter, bits=bits, group_size=32)
            built[key] = (hf, target, drafter)
        return built[key]

    return get


def final_hidden(model, tokens: mx.array) -> mx.array:
    """The trunk's final normalised state, from mlx-lm's own inner model."""
    inner = getattr(model, "language_model", model).model
    return inner(tokens)


class Recorder:
    """A sampler that takes the argmax and keeps every row it is given."""

    def __init__(self):
        self.rows = []

    def __call__(self, logits):
        self.rows.append(logits.reshape(-1, logits.shape[-1]))
        return mx.argmax(logits, axis=-1)


def vlm_rounds(hf: Path, model, prompt, bonus, second, verify_hidden):
    """mlx-vlm's drafter: its rows and drafts after the prompt, and after a
    round whose drafts were all rejected (``second`` committed)."""
    vlm, _ = vlm_load_drafter(str(hf))
    vlm.reset(model)
    rec = Recorder()
    tokens = mx.array([prompt])
    hidden = final_hidden(model, tokens)
    vlm.prefill_from_target_hidden(tokens, hidden, bonus, rec, greedy=False)
    first = vlm.draft_block(bonus, hidden[:, -1:], None, DRAFTS + 1, rec)
    vlm.accept_verified_tokens(verify_hidden, first, 0, [second], rec, greedy=False)
    later = vlm.draft_block(second, None, None, DRAFTS + 1, rec)
    rows = mx.concatenate(rec.rows, axis=0)
    drafts = first[0].tolist() + later[0].tolist()
    return rows, drafts


def our_rounds(model, drafter, prompt, bonus, second, layer_ids=None):
    target = TargetAdapter(model, layer_ids or drafter.config.target_layer_ids)
    proposer = MTPProposer(drafter)
    state = proposer.make_state()
    cache = target.make_cache()
    _, features = target(mx.array([prompt]), cache)
    greedy = SamplingParams()
    one = proposer.propose(
        state, Round(prompt + [bonus], features, DRAFTS, greedy, None)
    )
    _, verified = target(mx.array([[bonus, *one.tokens[0].tolist()]]), cache)
    round_two = Round(prompt + [bonus, second], verified[:, :1], DRAFTS, greedy, None)
    two = proposer.propose(state, round_two)
    rows = mx.concatenate([one.logits[0], two.logits[0]], axis=0)
    return rows, one.tokens[0].tolist() + two.tokens[0].tolist()


@pytest.mark.parametrize("variant", ["as-extracted", "norm offset dropped", "hidden"])
@pytest.mark.parametrize("model_type", TYPES)
def test_drafter_matches_mlx_vlm(checkpoint, model_type, variant):
    """Rows and greedy drafts equal mlx-vlm 0.7.10's drafter's, after the
    prompt and after a rejected round; a broken mapping (norms without their
    offset, or a state other than the trunk's final normalised one) fails."""
    hf, target_dir, drafter_dir = checkpoint(model_type)
    model, _, drafter = mlx_dspark.load(target_dir, drafter_dir)
    prompt = PROMPT
    bonus = int(mx.argmax(model(mx.array([prompt]))[0, -1]).item())
    layer_ids = None
    if variant == "norm offset dropped":
        flat = tree_flatten(drafter.parameters())
        norms = [(k, v - 1.0) for k, v in flat if k.endswith(OFFSET_NORMS)]
        drafter.load_weights(norms, strict=False)
    elif variant == "hidden":
        layer_ids = [drafter.config.num_target_layers - 2]
    ours, our_drafts = our_rounds(model, drafter, prompt, bonus, 0, layer_ids)
    verify = final_hidden(model, mx.array([prompt + [bonus]]))[:, -1:]
    verify = mx.concatenate([verify] * (DRAFTS + 1), axis=1)
    theirs, their_drafts = vlm_rounds(hf, model, prompt, bonus, 0, verify)
    close = ours.shape == theirs.shape and mx.allclose(ours, theirs, atol=1e-4).item()
    if variant == "as-extracted":
        assert close, mx.abs(ours - theirs).max().item()
        assert our_drafts == their_drafts
    else:
        assert not close


def greedy_run(model, tokenizer, drafter, prompt, **kwargs):
    responses = list(
        stream_generate(model, tokenizer, drafter, prompt, max_tokens=24, **kwargs)
    )
    return [r.token for r in responses], responses[-1].stats


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("model_type", TYPES)
def test_greedy_through_the_loop_is_mlx_lm_s(checkpoint, model_type, bits):
    """Fixed 3 drafts and the default policy: mlx-lm's greedy tokens, float
    and 4-bit (target and drafter), with rounds that keep drafts and rounds
    that reject them."""
    _, target_dir, drafter_dir = checkpoint(model_type, bits)
    model, tokenizer, drafter = mlx_dspark.load(target_dir, drafter_dir)
    kept = []
    for prompt in ([3, 14, 15, 9],):
        expected = [
            r.token
            for r in mlx_lm_stream_generate(
                model, tokenizer, mx.array(prompt), max_tokens=24
            )
        ]
        for extra in ({"num_draft": DRAFTS, "scheduler": "off"}, {}):
            tokens, stats = greedy_run(model, tokenizer, drafter, prompt, **extra)
            assert tokens == expected, (prompt, extra)
            if extra:
                kept += [r.accepted for r in stats.rounds if r.drafted]
    assert 0 < np.mean(kept) < DRAFTS, kept


@pytest.mark.parametrize("name", ["t1", "t0.8-minp-k"])
def test_seeded_sampling_is_mlx_lm_generate_s(checkpoint, name):
    _, target_dir, drafter_dir = checkpoint("qwen3_5")
    model, tokenizer, drafter = mlx_dspark.load(target_dir, drafter_dir)
    params = SETTINGS[name]
    kept = 0
    for seed in (0, 1, 7):
        expected = mlx_lm_tokens(model, tokenizer, params, seed)
        tokens, stats = dspark_tokens(
            model, tokenizer, drafter, params, seed, num_draft=DRAFTS, scheduler="off"
        )
        assert tokens == expected, seed
        kept += sum(r.accepted for r in stats.rounds)
    assert kept > 0


def test_sampling_through_the_loop_is_exact(checkpoint):
    _, target_dir, drafter_dir = checkpoint("qwen3_next")
    model, _, drafter = mlx_dspark.load(target_dir, drafter_dir)
    params = SamplingParams(temperature=1.0)
    prompt, seeds = [3, 1, 4], 150
    samples, stats = sample_first_three(
        model, drafter, params, seeds=seeds, prompt=prompt, num_draft=DRAFTS,
        max_tokens=5,
    )  # fmt: skip
    stat, dof = chi_square(samples, exact_joint(model, params, prompt), seeds)
    assert stat < chi_square_critical(dof), (stat, dof)
    accepted = [r.accepted for r in stats.rounds if r.drafted]
    assert 0 < np.mean(accepted) < DRAFTS


@pytest.mark.parametrize("bits", [None, 8])
def test_extraction_round_trip(tmp_path, bits):
    """The drafter holds the checkpoint's MTP tensors with the norm offset
    added once; only the shard holding mtp.* is read."""
    hf = save_hf_checkpoint(tmp_path / "hf", "qwen3_next")
    trunk = hf / "model-00001-of-00002.safetensors"
    trunk.write_bytes(b"not read")  # the index says mtp.* lives elsewhere
    out = tmp_path / "mtp"
    extract_mtp(hf, out, bits=bits, group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MTPDrafter"]
    text = json.loads((hf / "config.json").read_text())
    expected = mtp_weights("qwen3_next", text, 0, 0.3)
    written = mx.load(str(out / "model.safetensors"))
    if bits:
        assert config["quantization"] == {"group_size": 32, "bits": 8}
        name = "layers.0.self_attn.q_proj"
        weight = mx.dequantize(
            written[f"{name}.weight"], written[f"{name}.scales"],
            written[f"{name}.biases"], group_size=32, bits=8,
        )  # fmt: skip
        want = expected[f"{name}.weight"]
        assert np.abs(np.array(weight) - want).max() < 0.02
    names = ["norm.weight", "pre_fc_norm_hidden.weight"] + (
        [] if bits else ["fc.weight"]
    )
    for name in names:
        np.testing.assert_allclose(np.array(written[name]), expected[name], atol=1e-6)
    experts = written["layers.0.mlp.switch_mlp.up_proj.weight"]
    if not bits:
        np.testing.assert_allclose(
            np.array(experts), expected["layers.0.mlp.switch_mlp.up_proj.weight"],
            atol=1e-6,
        )  # fmt: skip
    assert not list(tmp_path.glob(".mtp*"))  # the temporary directory is gone


def cli(main, args: list, capsys) -> tuple[int, str, str]:
    """A command run in-process: its exit status, stdout and stderr."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as done:
        code = done.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_checkpoint_without_mtp_is_refused_in_one_sentence(
    tmp_path, checkpoint, capsys
):
    hf = save_hf_checkpoint(tmp_path / "hf", "qwen3_5", with_mtp=False)
    out = tmp_path / "mtp"
    code, _, err = cli(convert_main, ["--mtp", hf, "--out", out], capsys)
    assert code == 1
    assert err.count("\n") == 1 and "carries no MTP weights" in err, err
    assert not out.exists()
    with pytest.raises(DSparkError, match="no MTP"):
        extract_mtp(checkpoint("qwen3_5")[1], out)  # an mlx-lm conversion
    _, said, _ = cli(doctor_main, ["--model", hf], capsys)
    assert "carries no MTP weights" in said
    _, said, _ = cli(doctor_main, ["--model", checkpoint("qwen3_5")[0]], capsys)
    assert "carries MTP weights" in said


def test_cli_extracts_and_generates(tmp_path, checkpoint, capsys):
    """convert --mtp writes a 4-bit drafter that the generate command runs
    with the mlx-lm conversion, giving the target's own text."""
    # transformers gives qwen3_5 models Qwen3.5's own tokenizer class, which
    # the tiny word-level tokenizer is not: the CLI runs the Qwen3-Next one.
    hf, target_dir, _ = checkpoint("qwen3_next")
    out = tmp_path / "mtp-q4"
    args = ["--mtp", hf, "--out", out, "-q", "--q-bits", "4", "--q-group-size", "32"]
    code, said, err = cli(convert_main, args, capsys)
    assert code == 0 and "4-bit MTP drafter" in said, err
    common = ["--model", target_dir, "-p", "t1 t2 t3", "-m", "16"]
    code, drafted, err = cli(generate_main, [*common, "--draft-model", out], capsys)
    assert code == 0, err
    code, plain, err = cli(generate_main, [*common, "--verbose", "false"], capsys)
    assert code == 0, err
    assert drafted.split("=" * 10)[1].strip() == plain.strip()
    assert "Mean accepted length:" in drafted


def test_server_takes_an_mtp_drafter(checkpoint):
    """Greedy and seeded requests through the batch engine are mlx-lm's."""
    _, target_dir, drafter_dir = checkpoint("qwen3_next")
    model, tokenizer, drafter = mlx_dspark.load(target_dir, drafter_dir)
    engine = BatchEngine(model, tokenizer, drafter, EngineConfig(max_batch=2))
    assert isinstance(engine.proposer, MTPProposer)
    try:
        runs = [("greedy", SamplingParams(), 0), ("t1", SETTINGS["t1"], 1)]
        handles = {
            name: engine.submit(GenerationRequest([3, 14, 15, 9], params, 24, seed))
            for name, params, seed in runs
        }
        engine.start()
        for name, params, seed in runs:
            expected = mlx_lm_tokens(model, tokenizer, params, seed)
            assert served(handles[name]) == served_as(expected, tokenizer), name
        assert engine.stats.drafts_accepted > 0
    finally:
        engine.stop()
