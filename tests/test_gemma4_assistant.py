"""Gemma-4 assistant drafters (``*-assistant`` checkpoints) on a tiny Gemma-4
target built from mlx-lm's class: parity with mlx-vlm's drafter (pinned in
the dev extra), loading and conversion, and lossless decoding through the loop
(greedy, exact and seeded sampling, float and 4-bit)."""

import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from test_gemma4 import VOCAB, WINDOW, text_config, tiny_gemma4
from test_sampling import chi_square, chi_square_critical
from test_seed import PROMPT as SEED_PROMPT
from test_seed import SETTINGS, dspark_tokens, mlx_lm_tokens, served, served_as

import mlx_dspark
from mlx_dspark.checkpoints.gemma4_assistant import load_assistant
from mlx_dspark.cli.convert import main as convert_main
from mlx_dspark.decoding.loop import (
    GenerationStats,
    ThresholdPolicy,
    speculative_generate_step,
)
from mlx_dspark.errors import DSparkError
from mlx_dspark.generation import stream_generate
from mlx_dspark.pairs.structured import PairSpec, _tokenizer_files
from mlx_dspark.proposers.gemma4_assistant import AssistantDrafter, AssistantProposer
from mlx_dspark.proposers.gemma4_assistant_config import AssistantConfig
from mlx_dspark.sampling.processing import SamplingParams, log_probs
from mlx_dspark.serving import BatchEngine, EngineConfig, GenerationRequest
from mlx_dspark.targets.adapter import TargetAdapter

D = 32  # the target's width (test_gemma4's text_config)
PROMPT = [5, 7, 1, 2, 9, 3, 4, 0, 2, 11]  # longer than the window
# How much each target layer adds to the residual (its post norms' scale):
# the target mostly follows its LM head's permutation, with context.
PERTURBATION = 0.15


def target_model(seed: int = 3):
    """test_gemma4's tiny target (sliding window 6, KV-shared layers,
    per-layer inputs) with quieter layers, so that its greedy text mostly
    follows one token map that the structured assistant knows."""
    model = tiny_gemma4(seed=seed)
    quiet = {
        name: mx.full(value.shape, PERTURBATION)
        for name, value in tree_flatten(model.parameters())
        if name.endswith(
            ("post_attention_layernorm.weight", "feedforward_layernorm.weight")
        )
    }
    model.load_weights(list(quiet.items()), strict=False)
    mx.eval(model.parameters())
    return model


def assistant_config(ordered: bool = False, block: int | None = None) -> dict:
    """Shaped like the published ``*-assistant`` configs: the assistant's
    own ``text_config`` (all layers KV-shared), the target's width, the
    centroid head's settings."""
    config = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": D,
        "use_ordered_embeddings": ordered,
        "num_centroids": 4,
        "centroid_intermediate_top_k": 2,
        "tie_word_embeddings": True,
        "text_config": {
            **text_config(),
            "hidden_size": D,
            "num_hidden_layers": 2,
            "intermediate_size": 48,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "enable_moe_block": False,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "full_attention": {
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                    "rope_type": "proportional",
                },
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
        },
    }
    if block is not None:
        config["block_size"] = block
    return config


def assistant_weights(model, config: dict, seed: int = 0) -> dict[str, mx.array]:
    """Hugging Face-named tensors of an assistant that knows the target's
    token map: ``pre_projection`` reads the (scaled) token embedding back,
    the layers add a little, and the tied head is the target's LM head."""
    drafter = AssistantDrafter(AssistantConfig.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(drafter.parameters()):
        if name.endswith(
            ("post_attention_layernorm.weight", "feedforward_layernorm.weight")
        ):
            weights[name] = np.full(value.shape, 0.1, np.float32)
        elif name.endswith(("norm.weight", "layer_scalar")):
            weights[name] = np.ones(value.shape, np.float32)
        elif name.endswith("token_ordering"):
            weights[name] = rng.permutation(VOCAB).astype(np.int64)
        else:
            weights[name] = rng.standard_normal(value.shape).astype(np.float32)
            weights[name] /= np.sqrt(value.shape[-1])
    pre = np.zeros((D, 2 * D), np.float32)
    pre[:, :D] = np.eye(D) / np.sqrt(D)
    weights["pre_projection.weight"] = pre
    head = np.array(model.lm_head.weight)
    weights["model.embed_tokens.weight"] = head
    weights["lm_head.weight"] = head  # a tied copy, as Hugging Face may save it
    return {k: mx.array(v) for k, v in weights.items()}


def write_assistant(directory, model, ordered=False, seed=0, block=None):
    directory.mkdir(parents=True)
    config = assistant_config(ordered, block)
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(directory / "model.safetensors"), assistant_weights(model, config, seed)
    )
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(model, tokenizer, target dir, {name: assistant dir}) saved as users have them."""
    root = tmp_path_factory.mktemp("assistant")
    model = target_model()
    target_dir = root / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(text_config()))
    mx.save_safetensors(
        str(target_dir / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    for name, text in _tokenizer_files(PairSpec(vocab_size=VOCAB)).items():
        (target_dir / name).write_text(text)
    drafters = {
        "dense": write_assistant(root / "dense", model),
        "centroids": write_assistant(root / "centroids", model, ordered=True),
    }
    loaded, tokenizer, _ = mlx_dspark.load(target_dir)
    return loaded, tokenizer, target_dir, drafters


def plain_greedy(model, prompt, n):
    out = []
    for (token, _), _ in zip(
        generate_step(mx.array(prompt), model, max_tokens=n), range(n), strict=False
    ):
        out.append(int(token))
    return out


# ---------------------------------------------------------------- parity
vlm = pytest.importorskip("mlx_vlm.speculative.drafters.gemma4_assistant")


def vlm_drafter(model, directory):
    """mlx-vlm's drafter with the same checkpoint, bound to the target."""
    config = json.loads((directory / "config.json").read_text())
    theirs = vlm.Model(vlm.ModelConfig.from_dict(config))
    weights = mx.load(str(directory / "model.safetensors"))
    theirs.load_weights(list(theirs.sanitize(weights).items()))
    mx.eval(theirs.parameters())
    return theirs.bind(model)


class Compared:
    """Our assistant's proposer that also runs mlx-vlm's drafter on the same
    round (``broken``: a deliberately wrong input mapping on our side) and
    records both chains and first rows."""

    def __init__(self, ours, theirs, broken=None):
        self.inner, self.theirs, self.broken = AssistantProposer(ours), theirs, broken
        self.chains, self.rows = [], []

    def make_state(self):
        return self.inner.make_state()

    def propose(self, state, round):
        proposal = self.inner.propose(state, round)
        kv, hidden, start = round.target_kv(), state.hidden, round.start
        ours = self.inner.drafter
        embeds = ours.target_embed(mx.array([[round.anchor]]))
        if self.broken == "position":
            _, row = ours.step(embeds, hidden, kv, start)
        elif self.broken == "order":
            _, row = ours.step(hidden, embeds, kv, start - 1)
        else:
            _, row = ours.step(embeds, hidden, kv, start - 1)
        self.theirs.set_shared_kv(kv, start, position=start - 1, kv_valid_len=start)
        _, their_row = self.theirs(
            mx.concatenate([embeds, hidden], -1), kv, mx.array([[start - 1]])
        )
        n = proposal.tokens.shape[1]
        chain = self.theirs.draft_block(
            round.anchor, hidden, None, n + 1,
            lambda x: mx.argmax(x[:, -1:], axis=-1).astype(mx.int32), greedy=True,
        )  # fmt: skip
        self.rows.append((np.array(row[0, -1]), np.array(their_row[0, -1])))
        self.chains.append((proposal.tokens[0].tolist(), chain[0].tolist()))
        return proposal


def run_compared(model, directory, broken=None, max_tokens=30):
    ours = load_assistant(directory, model)
    target = TargetAdapter(model, ours.config.target_layer_ids)
    proposer = Compared(ours, vlm_drafter(model, directory), broken)
    stats = GenerationStats()
    tokens = [
        t
        for t, _ in speculative_generate_step(
            mx.array(PROMPT),
            target,
            proposer,
            num_draft=ours.block_size,
            max_tokens=max_tokens,
            policy=ThresholdPolicy(),
            stats=stats,
        )  # fmt: skip
    ]
    return tokens, proposer, stats


@pytest.mark.parametrize("kind", ["dense", "centroids"])
def test_rows_and_greedy_rounds_equal_mlx_vlm(pair, kind):
    """Every round of a generation past the sliding window: our first row
    equals mlx-vlm's drafter's on the same target state and cache, and our
    greedy chain is its ``draft_block``; the rounds accept and reject."""
    model, _, _, drafters = pair
    tokens, compared, stats = run_compared(model, drafters[kind])
    for ours, theirs in compared.rows:
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    for ours, theirs in compared.chains:
        assert ours == theirs
    assert tokens == plain_greedy(model, PROMPT, len(tokens))
    accepted = [r.accepted for r in stats.rounds if r.drafted]
    assert max(accepted) >= 1 and min(accepted) == 0, accepted
    assert len(PROMPT) + len(tokens) > 2 * WINDOW


@pytest.mark.parametrize("broken", ["position", "order"])
def test_a_wrong_mapping_fails_parity(pair, broken):
    """The parity check can fail: the query one position late, or the two
    halves of the drafter's input swapped, give other rows than mlx-vlm's."""
    model, _, _, drafters = pair
    _, compared, _ = run_compared(model, drafters["dense"], broken, max_tokens=12)
    gaps = [np.abs(ours - theirs).max() for ours, theirs in compared.rows]
    assert max(gaps) > 1e-2, gaps


# ------------------------------------------------------- loading, convert
def test_load_refuses_in_one_sentence(pair, tmp_path):
    model, _, target_dir, drafters = pair
    config = assistant_config()
    config["backbone_hidden_size"] = 48
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes(
        (drafters["dense"] / "model.safetensors").read_bytes()
    )
    with pytest.raises(DSparkError, match="width 48"):
        load_assistant(bad, model)
    (bad / "model.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(DSparkError, match="not a valid safetensors"):
        load_assistant(bad)


@pytest.mark.parametrize("bits", [None, 4])
def test_convert_then_generate_greedy_equals_mlx_lm(pair, tmp_path, bits):
    """``mlx_dspark.convert`` writes an MLX assistant (float or 4-bit) that
    ``load`` pairs with the target, and the default policy and a fixed
    draft count decode the target's own greedy tokens with it."""
    model, tokenizer, target_dir, drafters = pair
    out = tmp_path / "mlx"
    source = drafters["centroids" if bits is None else "dense"]
    args = ["--draft-model", str(source), "--out", str(out)]
    if bits:
        args += ["-q", "--q-bits", str(bits), "--q-group-size", "32"]
    convert_main(args)
    written = json.loads((out / "config.json").read_text())
    assert (written.get("quantization") or {}).get("bits") == bits
    _, _, drafter = mlx_dspark.load(target_dir, out)
    assert isinstance(drafter, AssistantDrafter)
    expected = plain_greedy(model, PROMPT, 24)
    eos = tokenizer.eos_token_ids
    expected = expected[: next((i for i, t in enumerate(expected) if t in eos), 24)]
    for fixed in (None, drafter.block_size):  # the default policy, then fixed
        responses = list(
            stream_generate(
                model, tokenizer, drafter, PROMPT, max_tokens=24, num_draft=fixed
            )
        )
        assert [r.token for r in responses][: len(expected)] == expected
    assert any(r.from_draft for r in responses)


def test_convert_refuses_a_wrong_checkpoint(tmp_path, capsys):
    source = tmp_path / "src"
    source.mkdir()
    config = assistant_config()
    del config["text_config"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--draft-model", str(source), "--out", str(tmp_path / "out")])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "text_config" in err[0], err
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------- sampling
def test_seeded_output_equals_mlx_lm_and_the_server(pair):
    """Seeded sampling commits ``mlx_lm.generate --seed``'s tokens, through
    ``stream_generate`` and the server."""
    model, tokenizer, target_dir, drafters = pair
    _, _, drafter = mlx_dspark.load(target_dir, drafters["dense"])
    params = SETTINGS["t0.7-p0.9"]
    engine = BatchEngine(model, tokenizer, drafter, EngineConfig(max_batch=2))
    try:
        handles = {}
        for seed in (0, 1):
            expected = mlx_lm_tokens(model, tokenizer, params, seed)
            for fixed in (None, drafter.block_size):  # the default policy, fixed
                tokens, stats = dspark_tokens(
                    model, tokenizer, drafter, params, seed, num_draft=fixed
                )
                assert tokens == expected
            assert any(r.drafted for r in stats.rounds)
            request = GenerationRequest(SEED_PROMPT, params, len(expected), seed)
            handles[seed] = engine.submit(request), expected
        engine.start()
        for handle, expected in handles.values():
            assert served(handle) == served_as(expected, tokenizer)
    finally:
        engine.stop()


def test_residual_sampling_is_exact(pair):
    """The first two tokens after the prompt, the second a draft of the
    assistant's kept or rejected by residual rejection sampling, follow the
    target's own distribution."""
    model, _, _, drafters = pair
    drafter = load_assistant(drafters["dense"], model)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    params = SamplingParams(temperature=1.0)
    prompt = mx.array(PROMPT[:4])
    runs = 150
    counts, drafted = Counter(), 0
    for seed in range(runs):
        steps = speculative_generate_step(
            prompt, target, AssistantProposer(drafter), params=params, num_draft=3,
            max_tokens=3, seed=seed, sampling="residual",
        )  # fmt: skip
        tokens = list(steps)
        drafted += tokens[1][1]
        counts[tuple(t for t, _ in tokens[:2])] += 1
    cache = target.make_cache()
    first = np.exp(np.array(log_probs(model(prompt[None], cache)[0, -1], params)))
    joint = {}
    for a in range(VOCAB):
        if first[a] < 1e-3:
            continue
        c = target.make_cache()
        row = model(mx.array([[*PROMPT[:4], a]]), c)[0, -1]
        second = np.exp(np.array(log_probs(row, params)))
        for b in range(VOCAB):
            joint[(a, b)] = first[a] * second[b]
    stat, dof = chi_square(counts, joint, runs)
    assert stat < chi_square_critical(dof), (stat, dof)
    assert 0 < drafted < runs  # the second token was a kept draft in some runs
