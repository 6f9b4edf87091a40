"""Time a Gemma-4 assistant drafter's round against target steps on this
machine, with random weights (no real checkpoint is needed for a cost):
a target of mlx-lm's ``gemma4_text`` class and an assistant shaped like the
published ones (a narrow model over the target's keys and values, a
centroid-routed head), both small enough for a CPU::

    python examples/gemma4_assistant_cost.py [--context 256] [--repeats 30]

It prints medians of: one target step (1 token), one verification of the
anchor and 3 drafts (4 tokens), one assistant draft step and one round of
3 drafts (what :class:`~mlx_dspark.proposers.gemma4_assistant.AssistantProposer`
does per round, the target's keys and values read from its cache included).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

# isort: off
import mlx_dspark  # noqa: F401 (first: a fast BLAS where there is one)
from mlx_dspark.machine import detect_blas
from mlx_dspark.proposers.base import Round
from mlx_dspark.proposers.gemma4_assistant import AssistantDrafter, AssistantProposer
from mlx_dspark.proposers.gemma4_assistant_config import AssistantConfig
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter

import mlx.core as mx
from mlx_lm.models import gemma4_text

# isort: on

VOCAB = 16384
ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}
TARGET = {
    "model_type": "gemma4_text",
    "hidden_size": 640,
    "num_hidden_layers": 16,
    "intermediate_size": 2560,
    "num_attention_heads": 4,
    "head_dim": 128,
    "global_head_dim": 256,
    "num_key_value_heads": 1,
    "num_kv_shared_layers": 6,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 64,
    "sliding_window": 512,
    "sliding_window_pattern": 5,
    "rope_parameters": ROPE,
    "tie_word_embeddings": True,
}
ASSISTANT = {
    "model_type": "gemma4_assistant",
    "architectures": ["Gemma4AssistantForCausalLM"],
    "backbone_hidden_size": TARGET["hidden_size"],
    "use_ordered_embeddings": True,
    "num_centroids": 128,
    "centroid_intermediate_top_k": 8,
    "tie_word_embeddings": True,
    "text_config": {
        **TARGET,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 1024,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "num_kv_shared_layers": 4,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
    },
}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(TARGET))
    drafter = AssistantDrafter(AssistantConfig.from_dict(ASSISTANT))
    mx.eval(model.parameters(), drafter.parameters())
    target = TargetAdapter(model)
    drafter.bind(target.input_embedding, target.num_layers)
    target = TargetAdapter(model, drafter.config.target_layer_ids)

    prompt = mx.random.randint(0, VOCAB, (1, args.context))
    cache = target.make_cache()
    _, features = target.hidden(prompt, cache)
    mx.eval(features)

    def forward(n: int) -> None:
        out = target(mx.random.randint(0, VOCAB, (1, n)), cache)
        mx.eval(out)
        target.rollback(cache, n)

    proposer = AssistantProposer(drafter)
    kv = partial(target.attention_kv, cache)
    tokens = prompt[0].tolist() + [1]

    def round_of(n: int) -> None:
        state = proposer.make_state()
        r = Round(tokens, features[:, -1:], n, SamplingParams(), None, target_kv=kv)
        mx.eval(proposer.propose(state, r).tokens)

    step = median_ms(partial(forward, 1), args.repeats)
    verify = median_ms(partial(forward, 4), args.repeats)
    one = median_ms(partial(round_of, 1), args.repeats)
    three = median_ms(partial(round_of, 3), args.repeats)
    blas = detect_blas()
    print(
        f"BLAS: {blas.kind} ({blas.gflops:.0f} GFLOP/s matmul); context {args.context}"
    )
    print(f"target step (1 token):      {step:7.2f} ms")
    print(
        f"target verify (4 tokens):   {verify:7.2f} ms  ({verify / step:.2f}x a step)"
    )
    print(f"assistant, 1 draft:         {one:7.2f} ms  ({one / step:.2f}x a step)")
    print(f"assistant round, 3 drafts:  {three:7.2f} ms  ({three / step:.2f}x a step)")


if __name__ == "__main__":
    main()
