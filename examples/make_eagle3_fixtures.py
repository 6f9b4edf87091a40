"""Write the EAGLE-3 reference fixtures in tests/data/eagle3/ from DeepSpec's
own EAGLE-3 code and the speculators package's own classes.

Needs a scratch environment (none of this is a dependency of the package):
torch (CPU), transformers 5.10.2 (DeepSpec's pin), safetensors, speculators 0.9,
this package installed (for MLX and the structured pair), and a copy of
deepseek-ai/DeepSpec (MIT) whose root holds ``deepspec/``::

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers==5.10.2 \
        safetensors speculators -e .
    git -C DeepSpec archive HEAD deepspec | tar -x -C /tmp/deepspec
    /tmp/ref/bin/python examples/make_eagle3_fixtures.py --deepspec /tmp/deepspec

What it writes (float32, about 0.7 MB):

* ``target/``: the structured Qwen3 target (an mlx-lm directory) and
  ``qwen3/``: its structured EAGLE-3 drafter in DeepSpec's layout
  (:mod:`mlx_dspark.pairs.eagle3_structured`); ``qwen3_rounds.json``: DeepSpec's
  greedy evaluator loop (``generate_decoding_sample`` with
  ``Qwen3Eagle3Evaluator``'s propose/update) on a few prompts: output
  tokens, committed tokens per round and each round's drafts;
  ``qwen3_round_logits.npy``: the draft logits of the first two rounds of
  the first prompt.
* ``qwen3_script.npz`` / ``gemma4_script.npz``: a scripted drafting session
  (prefill extension, three drafts, crop and extension with two committed
  positions, two drafts) on random features through DeepSpec's
  ``Qwen3Eagle3Model`` / ``Gemma4Eagle3Model``: inputs and every draft logit
  row; ``gemma4/`` holds the random Gemma-4 drafter.
* ``speculators_qwen3/``: ``qwen3/`` saved by speculators'
  ``Eagle3DraftModel`` with a reduced draft vocabulary (all tokens but the
  end-of-sequence one, so ``d2t`` has a non-zero offset).
* ``speculators_llama/`` and ``speculators_llama.npz``: a random two-layer
  Llama-style speculators drafter (``norm_before_residual``, ``fc_norm``,
  reduced vocabulary) and the logits its own modules give on random
  features (checked against the greedy drafts of its own forward).
* ``speculators_eagle31/`` and ``speculators_eagle31.npz``: a random
  Qwen3-layer drafter with ``norm_before_fc`` and ``norm_output`` and the
  greedy drafts of two training-time-test steps of the package's forward.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "eagle3"
PROMPTS = [[1, 2, 3], [5, 9, 11, 2, 7], [0, 4], [13, 6, 17, 8]]
MAX_NEW = 40
SCRIPT_PROMPT = 6  # positions in the scripted session's first extension


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}


def load_strict(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(
            f"weights do not fit: missing {missing}, unexpected {unexpected}"
        )


def deepspec_qwen3(config: dict, weights: dict):
    from deepspec.modeling.eagle3 import Qwen3Eagle3Model
    from transformers import Qwen3Config

    class RecordingQwen3Eagle3Model(Qwen3Eagle3Model):
        """Keeps the last row of every draft logit it computes."""

        def compute_logits(self, hidden_states):
            logits = super().compute_logits(hidden_states)
            self.recorded.append(logits[0, -1].clone())
            return logits

    cfg = Qwen3Config(**config)
    cfg._attn_implementation = "sdpa"
    model = RecordingQwen3Eagle3Model(cfg).float().eval()
    model.recorded = []
    load_strict(model, weights)
    return model


def propose_recording(evaluator, drafts: list, **kwargs):
    """The evaluator's proposal, its drafts appended to ``drafts``."""
    proposal = evaluator._propose(**kwargs)
    drafts.append(proposal.verify_input_ids[0, 1:].tolist())
    return proposal


def evaluator_rounds(target_dir: Path, draft_dir: Path) -> tuple[dict, np.ndarray]:
    from deepspec.eval.base_evaluator import generate_decoding_sample
    from deepspec.eval.eagle3.evaluator import Qwen3Eagle3Evaluator
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tcfg = Qwen3Config(**json.loads((target_dir / "config.json").read_text()))
    tcfg._attn_implementation = "sdpa"
    target = Qwen3ForCausalLM(tcfg).float().eval()
    load_strict(target, tensors(target_dir))
    draft_config = json.loads((draft_dir / "config.json").read_text())
    draft = deepspec_qwen3(draft_config, tensors(draft_dir))

    # The evaluator's propose/update without its distributed set-up.
    evaluator = Qwen3Eagle3Evaluator.__new__(Qwen3Eagle3Evaluator)
    evaluator.draft_model = draft
    evaluator.target_model = target
    evaluator.args = argparse.Namespace(temperature=0.0, max_new_tokens=MAX_NEW)

    runs, first_logits = [], []
    for index, prompt in enumerate(PROMPTS):
        drafts: list[list[int]] = []
        draft.recorded = []
        with torch.inference_mode():
            result = generate_decoding_sample(
                target_model=target,
                input_ids=torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                max_proposal_tokens=evaluator.max_proposal_tokens,
                temperature=0.0,
                stop_token_ids=None,
                init_context=evaluator._init_context,
                propose=partial(propose_recording, evaluator, drafts),
                update=evaluator._update,
            )
        output = result.output_ids[0, len(prompt) :].tolist()
        runs.append(
            {
                "prompt": prompt,
                "output": output,
                "acceptance_lengths": list(result.acceptance_lengths),
                "drafts": drafts,
            }
        )
        if index == 0:
            ttt = evaluator.max_proposal_tokens
            first_logits = torch.stack(draft.recorded[: 2 * ttt]).reshape(2, ttt, -1)
    record = {
        "max_new_tokens": MAX_NEW,
        "ttt_length": evaluator.max_proposal_tokens,
        "temperature": 0.0,
        "runs": runs,
    }
    return record, first_logits.numpy()


def scripted_session(model, feature_size: int, vocab: int, seed: int) -> dict:
    """Extend, draft three, crop and extend two committed, draft two: as the
    evaluator's _init_context / _propose / _update do, on random inputs."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    n = SCRIPT_PROMPT
    features = torch.randn(1, n + 2, feature_size, generator=g)
    tokens = torch.randint(0, vocab, (1, n + 2), generator=g)
    rows, drafted = [], []

    def draft(hidden, start, count):
        for k in range(count):
            logits = model.compute_logits(hidden)
            rows.append(logits[0, -1])
            token = logits[:, -1:].argmax(-1)
            drafted.append(int(token))
            if k + 1 < count:
                hidden = model(
                    hidden_states=hidden,
                    input_ids=token,
                    position_ids=torch.tensor([[start + k]]),
                    past_key_values=cache,
                    use_cache=True,
                )

    with torch.inference_mode():
        cache = DynamicCache()
        hidden = model.extend_draft_cache(
            hidden_states=features[:, :n],
            input_ids=tokens[:, :n],
            position_ids=torch.arange(n)[None],
            past_key_values=cache,
        )
        draft(hidden, n, 4)
        cache.crop(n)
        hidden = model.extend_draft_cache(
            hidden_states=features[:, n:],
            input_ids=tokens[:, n:],
            position_ids=torch.arange(n, n + 2)[None],
            past_key_values=cache,
        )
        draft(hidden, n + 2, 3)
    return {
        "features": features.numpy(),
        "tokens": tokens.numpy(),
        "logits": torch.stack(rows).numpy(),
        "drafts": np.array(drafted),
        "prompt_positions": np.array(n),
    }


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def gemma4_drafter(directory: Path):
    from deepspec.modeling.eagle3 import Gemma4Eagle3Model
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    config = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "head_dim": 8,
        "global_head_dim": 16,
        "attention_k_eq_v": True,
        "intermediate_size": 48,
        "vocab_size": 40,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 5.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "layer_types": ["full_attention"],
        "enable_moe_block": False,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    }
    extra = {
        "architectures": ["Gemma4Eagle3Model"],
        "model_type": "gemma4_text",
        "num_target_layers": 8,
        "target_layer_ids": [0, 2, 4, 5, 6],
        "ttt_length": 7,
        "step_loss_decay": 0.8,
        "draft_num_hidden_layers": 1,
    }
    cfg = Gemma4TextConfig(**config)
    for key, value in {**config, **extra}.items():
        if not hasattr(cfg, key):
            setattr(cfg, key, value)
    cfg._attn_implementation = "sdpa"
    model = Gemma4Eagle3Model(cfg).float().eval()
    randomize(model, seed=4)
    with torch.no_grad():
        model.layers[0].layer_scalar.fill_(0.8)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
    state = {
        k: v.contiguous() for k, v in model.state_dict().items() if "rotary" not in k
    }
    save_file(state, str(directory / "model.safetensors"))
    return model


def speculators_config(layer, draft_vocab: int, aux: list[int], **options):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer._attn_implementation = "eager"
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        eagle_aux_hidden_state_layer_ids=aux,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=7)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=None, architectures=["Qwen3ForCausalLM"]
            ),
        ),
        **options,
    )


def save_speculators(model, out: Path) -> None:
    """``save_pretrained`` without the config module it copies beside the
    weights (speculators' own code, which the fixtures do not need)."""
    model.save_pretrained(str(out))
    (out / "config.py").unlink(missing_ok=True)


def vocab_maps(ids: np.ndarray, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = torch.tensor(ids - np.arange(ids.size), dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.tensor(ids)] = True
    return d2t, t2d


def speculators_qwen3(draft_dir: Path, target_dir: Path, out: Path) -> None:
    """The DeepSpec-layout drafter as speculators saves it, over every token
    but end-of-sequence."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import Qwen3Config

    config = json.loads((draft_dir / "config.json").read_text())
    weights = tensors(draft_dir)
    vocab = config["vocab_size"]
    keys = (
        "hidden_size num_attention_heads num_key_value_heads head_dim "
        "intermediate_size vocab_size rms_norm_eps rope_theta "
        "max_position_embeddings"
    ).split()
    layer = Qwen3Config(num_hidden_layers=1, **{k: config[k] for k in keys})
    ids = np.array([i for i in range(vocab) if i != config["eos_token_id"]])
    spec = speculators_config(
        layer, ids.size, [i + 1 for i in config["target_layer_ids"]]
    )
    model = Eagle3DraftModel(spec).float()
    d2t, t2d = vocab_maps(ids, vocab)
    state = {k: v for k, v in weights.items() if k not in ("lm_head.weight",)}
    state["lm_head.weight"] = weights["lm_head.weight"][torch.tensor(ids)]
    state["embed_tokens.weight"] = tensors(target_dir)["model.embed_tokens.weight"]
    state["d2t"], state["t2d"] = d2t, t2d
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("verifier_")]
    if missing or unexpected:
        raise SystemExit(
            f"speculators model: missing {missing}, unexpected {unexpected}"
        )
    save_speculators(model, out)


def speculators_llama(out: Path) -> dict:
    """A random two-layer Llama-style speculators drafter and the logits its
    own layer classes give (eager causal attention) on random features."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import LlamaConfig

    vocab, d, aux = 40, 32, [1, 3, 6]
    layer = LlamaConfig(
        hidden_size=d,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    )
    rng = np.random.default_rng(5)
    ids = np.sort(rng.choice(vocab, size=24, replace=False))
    spec = speculators_config(
        layer, ids.size, aux, norm_before_residual=True, fc_norm=True
    )
    model = Eagle3DraftModel(spec).float().eval()
    randomize(model, seed=6)
    d2t, t2d = vocab_maps(ids, vocab)
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    g = torch.Generator().manual_seed(7)
    length = 9
    features = torch.randn(1, length, len(aux) * d, generator=g)
    tokens = torch.randint(0, vocab, (1, length), generator=g)
    with torch.inference_mode():
        chunks = features.chunk(len(aux), dim=-1)
        normed = [
            norm(chunk) for norm, chunk in zip(model.fc_norm, chunks, strict=True)
        ]
        hidden = model.fc(torch.cat(normed, dim=-1))
        x = torch.cat([model.embed_tokens(tokens), hidden], dim=-1)
        positions = torch.arange(length)[None]
        rope = model.rotary_emb(x, positions)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        for decoder_layer in model.layers:
            x = decoder_layer(
                x,
                attention_mask=causal,
                position_ids=positions,
                position_embeddings=rope,
            )
        logits = model.lm_head(model.norm(x))
        # The package's own (training) forward, one step: its greedy drafts.
        drafts = model(
            hidden_states=features,
            input_ids=tokens,
            document_ids=torch.zeros_like(tokens),
            ttt_steps=1,
        )[0]
    if not torch.equal(drafts[0], logits[0].argmax(-1)):
        raise SystemExit("the layer-by-layer reference disagrees with the package")
    save_speculators(model, out)
    return {
        "features": features.numpy(),
        "tokens": tokens.numpy(),
        "logits": logits[0].numpy(),
        "draft_to_target": ids,
    }


def speculators_eagle31(out: Path) -> dict:
    """A random Qwen3-layer speculators drafter with ``norm_before_fc`` and
    ``norm_output`` (EAGLE 3.1) over the full vocabulary, and the greedy
    drafts of two steps of its own forward: step two feeds back its normed
    outputs with the next true tokens (teacher forcing)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import Qwen3Config

    vocab, d, aux = 40, 32, [2, 4, 7]
    layer = Qwen3Config(
        hidden_size=d,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    )
    spec = speculators_config(layer, vocab, aux, norm_before_fc=True, norm_output=True)
    model = Eagle3DraftModel(spec).float().eval()
    randomize(model, seed=8)
    g = torch.Generator().manual_seed(9)
    length = 8
    features = torch.randn(1, length, len(aux) * d, generator=g)
    tokens = torch.randint(0, vocab, (1, length), generator=g)
    with torch.inference_mode():
        drafts = model(
            hidden_states=features,
            input_ids=tokens,
            document_ids=torch.zeros_like(tokens),
            ttt_steps=2,
        )
    save_speculators(model, out)
    return {
        "features": features.numpy(),
        "tokens": tokens.numpy(),
        "drafts": torch.cat(drafts).numpy(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspec", required=True, help="root of a DeepSpec copy")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    sys.path.insert(0, args.deepspec)
    torch.manual_seed(0)
    from mlx_dspark.pairs.eagle3_structured import build_eagle3_pair

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        target_dir, draft_dir = build_eagle3_pair(scratch)
        shutil.copytree(target_dir, out / "target")
        shutil.copytree(draft_dir, out / "qwen3")
    record, logits = evaluator_rounds(out / "target", out / "qwen3")
    (out / "qwen3_rounds.json").write_text(json.dumps(record, indent=1))
    np.save(out / "qwen3_round_logits.npy", logits)

    config = json.loads((out / "qwen3" / "config.json").read_text())
    qwen3 = deepspec_qwen3(config, tensors(out / "qwen3"))
    features = len(config["target_layer_ids"]) * config["hidden_size"]
    np.savez(
        out / "qwen3_script.npz",
        **scripted_session(qwen3, features, config["vocab_size"], seed=1),
    )
    gemma4 = gemma4_drafter(out / "gemma4")
    np.savez(
        out / "gemma4_script.npz",
        **scripted_session(gemma4, 5 * 32, 40, seed=2),
    )
    speculators_qwen3(out / "qwen3", out / "target", out / "speculators_qwen3")
    np.savez(
        out / "speculators_llama.npz", **speculators_llama(out / "speculators_llama")
    )
    np.savez(
        out / "speculators_eagle31.npz",
        **speculators_eagle31(out / "speculators_eagle31"),
    )
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
