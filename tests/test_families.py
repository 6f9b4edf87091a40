"""Every supported mlx-lm family, float and 4-bit (``mlx_lm.convert -q``):
the adapter reproduces the model's own call, rejected drafts roll back
exactly (past the sliding window; recurrent state included), greedy output
equals mlx-lm's with drafts accepted and rejected, a drafter trains, and
sampling stays exact on a sliding-window and a hybrid family."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from test_gemma4 import OracleMode, exact_joint, sample_three, temporal
from test_sampling import chi_square, chi_square_critical
from tiny_families import (
    CONFIGS,
    RECURRENT_FAMILIES,
    SLIDING_FAMILIES,
    TAPS,
    VOCAB,
    WINDOW,
    quantized_copy,
)

from mlx_dspark import load, stream_generate
from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.proposers.dspark import DSparkDrafter
from mlx_dspark.proposers.dspark_config import DraftConfig
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import RecurrentCache, TargetAdapter, WindowKVCache
from mlx_dspark.training.run import TrainArgs, train

FAMILIES = sorted(CONFIGS)
BITS = [None, 4]
PROMPT = [5, 7, 1, 2, 9, 3, 4, 0, 2, 11, 6]
MAX_TOKENS = 5 * WINDOW  # several windows


def plain_greedy(model, prompt, max_tokens=MAX_TOKENS) -> list[int]:
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]


def bigram_drafter(adapter: TargetAdapter, block_size: int = 4) -> DSparkDrafter:
    """A drafter whose Markov head proposes the target's one-token map (what
    the target predicts after each token alone): often right, not always."""
    config = DraftConfig.from_dict(
        {
            "architectures": ["Qwen3DSparkModel"],
            "hidden_size": adapter.hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "intermediate_size": 64,
            "vocab_size": VOCAB,
            "block_size": block_size,
            "mask_token_id": VOCAB - 1,
            "target_layer_ids": TAPS,
            "markov_rank": VOCAB,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        }
    )
    mx.random.seed(0)
    drafter = DSparkDrafter(config)
    drafter.share_embeddings(adapter.embed, adapter.lm_head)
    logits, _ = adapter(mx.arange(VOCAB)[:, None], adapter.make_cache())
    following = np.array(mx.argmax(logits[:, -1], axis=-1))
    w2 = np.zeros((VOCAB, VOCAB), np.float32)
    w2[following, np.arange(VOCAB)] = 6.0
    head = drafter.markov_head
    head.markov_w1.weight = mx.eye(VOCAB)
    head.markov_w2.weight = mx.array(w2)
    mx.eval(drafter.parameters())
    return drafter


@pytest.mark.parametrize("bits", BITS, ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_adapter_reproduces_the_models_own_call(family, model_type, bits):
    model, _, _ = family(model_type, bits)
    adapter = TargetAdapter(model, [-1, *TAPS, 3])
    adapter.self_check()
    assert adapter.hidden_size == 64 and adapter.vocab_size == VOCAB
    tokens = mx.array([PROMPT * 2])
    logits, features = adapter(tokens, adapter.make_cache())
    assert mx.allclose(logits, model(tokens), atol=1e-4).item()
    assert features.shape == (1, tokens.shape[1], 4 * 64)
    # The last layer's tap is the normalised state the head reads.
    assert mx.allclose(adapter.lm_head(features[..., -64:]), logits, atol=1e-4).item()
    kinds = set(adapter.rollback_kinds)
    assert ("sliding window un-appended" in kinds) == (model_type in SLIDING_FAMILIES)
    assert ("state restored and replayed" in kinds) == (
        model_type in RECURRENT_FAMILIES
    )
    assert adapter.supports_tree == (
        model_type in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
    )


def _same_state(ours, theirs, position: int) -> None:
    if isinstance(theirs, RotatingKVCache):
        assert isinstance(ours, WindowKVCache)
        want = tuple(w[..., -WINDOW:, :] for w in temporal(theirs))
        got = ours.window_state()
    elif isinstance(theirs, ArraysCache):
        assert isinstance(ours, RecurrentCache)
        want, got = theirs.cache, ours.cache
    else:
        assert isinstance(ours, KVCache) and ours.offset == theirs.offset == position
        want = tuple(s[..., :position, :] for s in theirs.state[:2])
        got = tuple(s[..., :position, :] for s in ours.state[:2])
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert mx.allclose(g, w, atol=1e-3).item()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rollbacks_give_plain_decodings_logits_and_caches(family, model_type):
    """Rounds of 1..6 tokens, partly rejected and rolled back, give plain
    decoding's logits, and leave the caches plain decoding would hold."""
    model, _, _ = family(model_type)
    adapter = TargetAdapter(model, TAPS)
    sequence = PROMPT + plain_greedy(model, PROMPT)
    plain = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=plain)
    plain_logits = [
        model(mx.array([[t]]), cache=plain)[0, -1] for t in sequence[len(PROMPT) - 1 :]
    ]
    cache = adapter.make_cache()
    adapter(mx.array([PROMPT[:-1]]), cache)
    rng = np.random.default_rng(0)
    position, rejected = len(PROMPT) - 1, 0
    while position < len(sequence) - 7:
        size = int(rng.integers(1, 7))
        keep = int(rng.integers(1, size + 1))
        block = sequence[position : position + size]
        if keep < size:
            block[keep] = (block[keep] + 1) % VOCAB
            rejected += 1
        logits, _ = adapter(mx.array([block]), cache)
        adapter.rollback(cache, size - keep)
        for i in range(keep):
            want = plain_logits[position + i - len(PROMPT) + 1]
            assert mx.allclose(logits[0, i], want, atol=1e-3).item(), position + i
        position += keep
    assert rejected > 5 and position > 3 * WINDOW
    plain = make_prompt_cache(model)
    for t in sequence[:position]:
        model(mx.array([[t]]), cache=plain)
    assert len(cache) == len(plain)
    for ours, theirs in zip(cache, plain, strict=True):
        _same_state(ours, theirs, position)


@pytest.mark.parametrize("bits", BITS, ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_identical_to_mlx_lm(family, model_type, bits):
    model, tokenizer, _ = family(model_type, bits)
    adapter = TargetAdapter(model, TAPS)
    drafter = bigram_drafter(adapter)
    expected = plain_greedy(model, PROMPT)
    stats = GenerationStats()
    for num_draft in (1, 3):
        for mode in (None, OracleMode(expected, seed=num_draft)):
            tokens = speculative_generate_step(
                mx.array(PROMPT),
                adapter,
                pair_proposer(drafter),
                num_draft=num_draft,
                max_tokens=MAX_TOKENS,
                mode=mode,
                stats=stats,
            )
            assert [t for t, _ in tokens] == expected, (num_draft, mode)
    assert any(r.accepted > 0 for r in stats.rounds)
    assert any(r.accepted < r.verified for r in stats.rounds)
    # The default policy (no DSpark arguments), as mlx_dspark.generate runs it.
    eos = tokenizer.eos_token_ids
    end = next((i for i, t in enumerate(expected) if t in eos), len(expected))
    responses = list(
        stream_generate(model, tokenizer, drafter, PROMPT, max_tokens=MAX_TOKENS)
    )
    assert [r.token for r in responses][:end] == expected[:end]


@pytest.mark.parametrize("bits", BITS, ids=["float", "q4"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_drafter_trains_and_decodes_losslessly(family, model_type, bits, tmp_path):
    model, _, path = family(model_type, bits)
    rng = np.random.default_rng(1)
    lines = []
    for _ in range(6):
        prompt = rng.integers(0, VOCAB - 2, 3).tolist()
        text = prompt + plain_greedy(model, prompt, 40)
        words = [f"t{t}" if t < VOCAB - 2 else "</s>" for t in text]
        lines.append(json.dumps({"text": " ".join(words)}))
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    result = train(
        TrainArgs(
            model=str(path),
            data=[str(data)],
            out=str(tmp_path / "drafter"),
            steps=3,
            batch_size=2,
            anchors=8,
            seq_len=64,
            layers=1,
            block_size=4,
            markov_rank=8,
            dtype="float32",
            # Beside a quantized target, a drafter with its own quantization.
            quantize_bits=bits,
            quantize_group_size=32,
            quiet=True,
        )
    )
    assert result.status == "done" and result.step == 3
    written = json.loads((result.out / "config.json").read_text())
    assert ("quantization" in written) == (bits is not None)
    target, tokenizer, drafter = load(path, result.out)
    expected = plain_greedy(target, PROMPT, 16)
    tokens = speculative_generate_step(
        mx.array(PROMPT),
        TargetAdapter(target, drafter.config.target_layer_ids),
        pair_proposer(drafter),
        num_draft=3,
        max_tokens=16,
    )
    assert [t for t, _ in tokens] == expected


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_5"])
def test_sampling_is_exact(family, model_type):
    model, _, _ = family(model_type)
    adapter = TargetAdapter(model, TAPS)
    drafter = bigram_drafter(adapter, block_size=3)
    # Hot enough that many outcomes are likely (the map is sharp).
    params = SamplingParams(temperature=3.0)
    prompt = PROMPT[: WINDOW + 1]  # the window has wrapped
    joint = exact_joint(model, params, prompt, VOCAB)
    seeds = 1500
    samples, stats = sample_three(adapter, drafter, prompt, params, seeds)
    stat, dof = chi_square(samples, joint, seeds)
    assert dof >= 10
    assert stat < chi_square_critical(dof), (stat, dof)
    assert any(r.accepted > 0 for r in stats.rounds)
    assert any(r.accepted < r.verified for r in stats.rounds)


def test_quantized_targets_keep_their_packed_weights(family):
    """The 4-bit model is the one mlx_lm.convert wrote: its embedding is packed,
    and the adapter reads sizes from the modules, not from packed shapes."""
    model, _, _ = family("qwen3", 4)
    adapter = TargetAdapter(model, TAPS)
    assert adapter.embedding.weight.shape == (VOCAB, 64 * 4 // 32)
    assert adapter.hidden_size == 64
    names = {k for k, _ in tree_flatten(model.parameters())}
    assert any(k.endswith("q_proj.scales") for k in names)


def test_doctor_says_whether_a_model_can_be_a_target(family, tmp_path):
    from test_doctor import run_doctor

    _, _, quantized = family("gemma3", 4)
    result = run_doctor("--model", str(quantized))
    assert result.returncode == 0, result.stderr
    assert "supported (gemma3, 4-bit)" in result.stdout
    assert "sliding window un-appended" in result.stdout
    result = run_doctor("--model", str(family("qwen3_5")[2]), "--json")
    report = json.loads(result.stdout)
    assert report["supported"] and not report["tree"]
    assert "state restored and replayed" in report["rollback"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    result = run_doctor("--model", str(tmp_path))
    assert result.returncode == 1
    assert "'mamba' is not supported" in " ".join(result.stdout.split())
    result = run_doctor("--model", str(tmp_path / "nowhere"))
    assert result.returncode == 1 and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "model_type, bits", [("gemma3_text", 4), ("qwen3_5", None), ("qwen3", 4)]
)
def test_the_server_batches_requests_of_every_cache_kind(family, model_type, bits):
    """Concurrent requests through the batch engine, with windows and recurrent
    states kept per request, equal mlx-lm's greedy output each."""
    from test_server import collect

    from mlx_dspark.serving import BatchEngine, EngineConfig, GenerationRequest

    model, tokenizer, _ = family(model_type, bits)
    drafter = bigram_drafter(TargetAdapter(model, TAPS))
    prompts = [PROMPT, PROMPT[3:], [4, 4, 9]]
    engine = BatchEngine(model, tokenizer, drafter, EngineConfig(num_draft=3))
    handles = [engine.submit(GenerationRequest(p, max_tokens=24)) for p in prompts]
    engine.start()
    try:
        got = collect(handles)
    finally:
        engine.stop()
    eos = tokenizer.eos_token_ids
    for prompt, tokens in zip(prompts, got, strict=True):
        expected = plain_greedy(model, prompt, 24)
        end = next((i for i, t in enumerate(expected) if t in eos), len(expected))
        assert tokens[:end] == expected[:end]
    assert engine.stats.drafts_accepted > 0


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_5"])
def test_calibration_records_rounds_on_quantized_targets(family, model_type):
    from mlx_dspark.policy.calibrate import collect_records, fit_records

    model, _, _ = family(model_type, 4)
    drafter = bigram_drafter(TargetAdapter(model, TAPS))
    records, groups = collect_records(model, drafter, [PROMPT, PROMPT[4:]], 12)
    assert len(records) == 12 and set(groups) == {0, 1}
    result = fit_records(records, groups, drafter.block_size)
    assert len(result.temperatures) == drafter.block_size


RECIPES = {
    "2-bit g64": {"bits": 2, "q_group_size": 64},
    "3-bit": {"bits": 3},
    "5-bit": {"bits": 5},
    "6-bit": {"bits": 6},
    "8-bit g128": {"bits": 8, "q_group_size": 128},
    "mixed_3_6": {"quant_predicate": "mixed_3_6"},
    "mxfp4": {"q_mode": "mxfp4", "q_group_size": None},
    "nvfp4": {"q_mode": "nvfp4", "q_group_size": None},
    "mxfp8": {"q_mode": "mxfp8", "q_group_size": None, "bits": 8},
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_quantization_mlx_lm_convert_writes(family, recipe, tmp_path):
    """Affine 2-8 bits at several group sizes, a mixed recipe and the float
    modes: the adapter reproduces the model, greedy output equals mlx-lm's,
    and a drafter trains on its features."""
    _, _, source = family("qwen3")
    path = quantized_copy(source, tmp_path / "q", **RECIPES[recipe])
    model, _ = mlx_lm_load(str(path))
    adapter = TargetAdapter(model, TAPS)
    adapter.self_check()
    expected = plain_greedy(model, PROMPT, 24)
    tokens = speculative_generate_step(
        mx.array(PROMPT),
        adapter,
        pair_proposer(bigram_drafter(adapter)),
        num_draft=3,
        max_tokens=24,
        mode=OracleMode(expected),
    )
    assert [t for t, _ in tokens] == expected
    data = tmp_path / "data.txt"
    data.write_text(" ".join(f"t{t}" for t in PROMPT + expected) + "\n")
    result = train(
        TrainArgs(
            model=str(path),
            data=[str(data)],
            out=str(tmp_path / "drafter"),
            steps=2,
            batch_size=1,
            anchors=4,
            seq_len=64,
            layers=1,
            block_size=4,
            markov_rank=8,
            dtype="float32",
            quiet=True,
        )
    )
    assert result.status == "done"
