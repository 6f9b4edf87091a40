"""What an MTP drafter's round costs against a target step, on this machine.

    python examples/mtp_round_cost.py [--hidden D] [--layers L] [--vocab V]

A Qwen3.5-shaped hybrid target (mlx-lm's own class, random weights, 3
linear-attention layers to 1 full-attention layer, float32) and an MTP module
of the same width (:class:`mlx_dspark.proposers.mtp.MTPDrafter`, random
weights, the target's embedding and LM head), timed by the default policy's
own profiler (:func:`mlx_dspark.policy.profile.measure_profile`): seconds per
target forward at 1..4 query tokens, and per drafting round (the committed
token taken in, then 3 drafts), at contexts of 64 and 256 tokens. Random
weights: acceptance is not measured, only cost.
"""

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import argparse

import mlx.core as mx
from mlx_lm.models import qwen3_5

from mlx_dspark.blas import mapped_libraries
from mlx_dspark.policy.profile import measure_profile
from mlx_dspark.proposers.mtp import MTPDrafter
from mlx_dspark.proposers.mtp_config import MTPConfig
from mlx_dspark.targets.adapter import TargetAdapter


def text_config(hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // 64
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 4, 1),
        "head_dim": 64,
        "vocab_size": vocab,
        "linear_num_value_heads": heads,
        "linear_num_key_heads": max(heads // 2, 1),
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    text = text_config(args.hidden, args.layers, args.vocab)
    model = qwen3_5.Model(
        qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text})
    )
    mx.eval(model.parameters())
    drafter = MTPDrafter(MTPConfig("qwen3_5", dict(text), args.layers))
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    drafter.share_embeddings(target.embed, target.lm_head)
    mx.eval(drafter.parameters())
    curve = measure_profile(target, drafter, n_max=drafter.block_size)
    step = {
        b: 1 / s for b, s in zip(curve.batch_sizes, curve.steps_per_second, strict=True)
    }
    blas = [p for p in mapped_libraries() if "blas" in p.lower()]
    print(f"BLAS: {', '.join(blas) or 'MLX bundled'}")
    print(
        f"target d={args.hidden}, {args.layers} layers, vocab {args.vocab}; "
        f"MTP module: 1 layer, {drafter.block_size} drafts a round"
    )
    for b, t in step.items():
        print(f"target forward, {b} tokens: {t * 1e3:.2f} ms")
    print(f"MTP round (1 taken in, {drafter.block_size} drafts): "
          f"{curve.draft_seconds * 1e3:.2f} ms = {curve.draft_seconds / step[1]:.2f} "
          "target steps")  # fmt: skip


if __name__ == "__main__":
    main()
