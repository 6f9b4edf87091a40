"""Loading DeepSpec-format drafters, pair validation and the target adapter."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import HEADS, head_id
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache

from mlx_dspark import load, stream_generate
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.errors import DSparkError
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.targets.adapter import TargetAdapter, WindowKVCache


def greedy(model, prompt, n=24):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_load_deepspec_directory(tmp_path, head, dtype):
    spec = PairSpec(markov_head_type=head, confidence_with_markov=head != "gated")
    target_dir, drafter_dir = build_structured_pair(tmp_path, spec, dtype=dtype)
    model, tokenizer, drafter = load(target_dir, drafter_dir)
    names = {k for k, _ in tree_flatten(drafter.parameters())}
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert drafter.shares_embeddings
    assert (drafter.markov_head is None) == (head is None)
    if head:
        assert (
            type(drafter.markov_head).__name__
            == {"vanilla": "MarkovHead", "gated": "GatedMarkovHead", "rnn": "RNNHead"}[
                head
            ]
        )
    assert (
        drafter.confidence_head.proj.weight.shape[-1]
        == drafter.config.confidence_input_dim
    )
    tokens = [
        r.token
        for r in stream_generate(model, tokenizer, drafter, [1, 2, 3], max_tokens=24)
    ]
    assert tokens == greedy(model, [1, 2, 3])


def _rewrite(drafter_dir, config=None, weights=None):
    if config is not None:
        data = json.loads((drafter_dir / "config.json").read_text())
        data.update(config)
        (drafter_dir / "config.json").write_text(json.dumps(data))
    if weights is not None:
        tensors = mx.load(str(drafter_dir / "model.safetensors"))
        weights(tensors)
        mx.save_safetensors(str(drafter_dir / "model.safetensors"), tensors)


def test_checkpoint_without_embeddings_shares_the_targets(tmp_path):
    target_dir, drafter_dir = build_structured_pair(tmp_path)
    _rewrite(
        drafter_dir,
        weights=lambda w: [w.pop(k) for k in ("embed_tokens.weight", "lm_head.weight")],
    )
    _, _, drafter = load(target_dir, drafter_dir)
    assert drafter.shares_embeddings


def test_checkpoint_with_different_embeddings_keeps_its_own(tmp_path):
    target_dir, drafter_dir = build_structured_pair(tmp_path)

    def perturb(w):
        w["lm_head.weight"] = w["lm_head.weight"] * 0.5

    _rewrite(drafter_dir, weights=perturb)
    model, _, drafter = load(target_dir, drafter_dir)
    assert not drafter.shares_embeddings
    names = {k for k, _ in tree_flatten(drafter.parameters())}
    assert {"embed_tokens.weight", "lm_head.weight"} <= names
    assert np.allclose(
        np.array(drafter.lm_head.weight), 0.5 * np.array(model.lm_head.weight)
    )


@pytest.fixture
def pair_dirs(tmp_path):
    return build_structured_pair(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 96}, "hidden size"),
        ({"vocab_size": 40}, "vocabulary"),
        ({"num_target_layers": 5}, "layers"),
        ({"target_layer_ids": [7]}, "must lie in"),
        ({"mask_token_id": 99}, "mask_token_id"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
        (
            {"architectures": ["Gemma4DSparkModel"]},
            "Gemma4DSparkModel config is missing",
        ),
        ({"architectures": ["LlamaForCausalLM"]}, "Not a DSpark drafter"),
    ],
)
def test_mismatched_or_unsupported_drafters_are_refused(pair_dirs, change, message):
    target_dir, drafter_dir = pair_dirs
    _rewrite(drafter_dir, config=change)
    with pytest.raises(DSparkError, match=message):
        load(target_dir, drafter_dir)


def test_missing_tensor_is_refused(pair_dirs):
    target_dir, drafter_dir = pair_dirs
    _rewrite(drafter_dir, weights=lambda w: w.pop("fc.weight"))
    with pytest.raises(DSparkError, match="missing tensors: fc.weight"):
        load(target_dir, drafter_dir)


def test_truncated_safetensors_is_refused(pair_dirs):
    target_dir, drafter_dir = pair_dirs
    file = drafter_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(DSparkError, match="truncated"):
        load(target_dir, drafter_dir)


def test_missing_paths_are_refused(tmp_path, pair_dirs):
    target_dir, _ = pair_dirs
    with pytest.raises(DSparkError, match="does not exist"):
        load(tmp_path / "nowhere")
    with pytest.raises(DSparkError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")
    with pytest.raises(DSparkError, match="no config.json"):
        load(target_dir, tmp_path)


def _tiny_config(model_type, **extra):
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 48,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    }
    config.update(extra)
    return config


FAMILIES = {
    "llama": lambda **kw: llama.Model(
        llama.ModelArgs.from_dict(_tiny_config("llama", **kw))
    ),
    "qwen2": lambda **kw: qwen2.Model(
        qwen2.ModelArgs.from_dict(_tiny_config("qwen2", **kw))
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapter_taps_match_the_models_own_forward(family):
    mx.random.seed(1)
    model = FAMILIES[family]()
    adapter = TargetAdapter(model, [-1, 0, 1])
    adapter.self_check()
    tokens = mx.array([[1, 5, 9, 2, 7]])
    logits, features = adapter(tokens, adapter.make_cache())
    assert features.shape == (1, 5, 3 * 64)
    assert np.allclose(
        np.array(features[..., :64]),
        np.array(model.model.embed_tokens(tokens)),
        atol=1e-6,
    )
    assert np.allclose(np.array(logits), np.array(model(tokens)), atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_last_layers_tap_is_the_normalised_state_the_head_reads(family):
    mx.random.seed(1)
    model = FAMILIES[family]()
    adapter = TargetAdapter(model, [0, 2])
    tokens = mx.array([[1, 5, 9, 2, 7]])
    logits, features = adapter(tokens, adapter.make_cache())
    from_tap = adapter.lm_head(features[..., 64:])
    assert np.allclose(np.array(from_tap), np.array(logits), atol=1e-5)
    chain = list(range(-1, tokens.shape[1] - 1))
    _, tree_features = adapter.tree_forward(tokens, chain, adapter.make_cache())
    assert np.allclose(np.array(tree_features), np.array(features), atol=1e-4)


def test_adapter_rolls_back_the_cache():
    mx.random.seed(2)
    model = FAMILIES["llama"]()
    adapter = TargetAdapter(model, [0])
    cache = adapter.make_cache()
    adapter(mx.array([[1, 2, 3]]), cache)
    adapter(mx.array([[4, 5, 6, 7]]), cache)
    adapter.rollback(cache, 3)
    assert cache[0].offset == 4
    step, _ = adapter(mx.array([[8]]), cache)
    reference = model(mx.array([[1, 2, 3, 4, 8]]))
    assert np.allclose(np.array(step[0, -1]), np.array(reference[0, -1]), atol=1e-4)


def test_sliding_window_llama_keeps_window_caches_and_refuses_trees():
    model = FAMILIES["llama"](
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=16,
    )
    adapter = TargetAdapter(model, [0])
    assert [type(c) for c in adapter.make_cache()] == [
        WindowKVCache,
        KVCache,
        WindowKVCache,
    ]
    assert not adapter.supports_tree
    with pytest.raises(DSparkError, match="Tree verification does not support llama"):
        adapter.check_tree()


def test_unsupported_family_is_refused():
    class Other:
        model_type = "mamba"

    with pytest.raises(DSparkError, match="type 'mamba' is not supported"):
        TargetAdapter(Other(), [0])


class SkippedLayerAdapter(TargetAdapter):
    """A deliberately broken tap: it drops the target's second layer."""

    def __call__(self, tokens, cache):
        layers = self.layers
        self.layers = [layers[0], *layers[2:]]
        try:
            return super().__call__(tokens, cache[:1] + cache[2:])
        finally:
            self.layers = layers


def test_self_check_refuses_a_broken_tap():
    mx.random.seed(3)
    model = FAMILIES["llama"]()
    TargetAdapter(model, [0]).self_check()
    with pytest.raises(DSparkError, match="does not reproduce"):
        SkippedLayerAdapter(model, [0]).self_check()


def _break_target(target_dir, how):
    weights_file = target_dir / "model.safetensors"
    if how == "truncated weights":
        weights_file.write_bytes(
            weights_file.read_bytes()[: weights_file.stat().st_size // 2]
        )
    elif how == "garbled weights":
        weights_file.write_bytes(b"\xff" * 64)
    elif how == "no weights":
        weights_file.unlink()
    elif how == "no config":
        (target_dir / "config.json").unlink()
    elif how == "truncated config":
        text = (target_dir / "config.json").read_text()
        (target_dir / "config.json").write_text(text[: len(text) // 2])
    elif how == "truncated tokenizer":
        text = (target_dir / "tokenizer.json").read_text()
        (target_dir / "tokenizer.json").write_text(text[: len(text) // 2])
    elif how == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
            (target_dir / name).unlink(missing_ok=True)
    elif how in ("missing key", "wrong shape"):
        weights = mx.load(str(weights_file))
        name = next(k for k in sorted(weights) if k.endswith("mlp.up_proj.weight"))
        if how == "missing key":
            weights.pop(name)
        else:
            weights[name] = weights[name][:, :-1]
        mx.save_safetensors(str(weights_file), weights)
    elif how == "unknown model type":
        config = json.loads((target_dir / "config.json").read_text())
        (target_dir / "config.json").write_text(
            json.dumps({**config, "model_type": "no_such_family"})
        )


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated weights", "model.safetensors is truncated"),
        ("garbled weights", "model.safetensors is truncated"),
        ("no weights", "has no model.safetensors weights"),
        ("no config", "has no config.json"),
        ("truncated config", "config.json is not valid JSON"),
        ("truncated tokenizer", "tokenizer.json is not valid JSON"),
        ("no tokenizer", "has no tokenizer"),
        ("missing key", "do not fit its config.json"),
        ("wrong shape", "do not fit its config.json"),
        ("unknown model type", "Could not load the model"),
    ],
)
def test_broken_target_directories_are_refused_in_one_sentence(pair_dirs, how, message):
    target_dir, drafter_dir = pair_dirs
    _break_target(target_dir, how)
    with pytest.raises(DSparkError, match=message) as error:
        load(target_dir, drafter_dir)
    assert "\n" not in str(error.value)
