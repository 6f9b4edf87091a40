"""Rolling back a linear-attention state: replay against per-token states.

    python examples/recurrent_rollback_ab.py [--rounds N] [--hidden D]

A Qwen3.5-style hybrid target (mlx-lm's own class, random weights, 3 linear-
attention layers to 1 full-attention layer) verifies rounds of 8 tokens and
keeps 1..8 of them. Two ways to leave the recurrent state where plain decoding
would:

- replay (what the adapter does): one forward over the 8 tokens, then the
  state before it restored and each linear-attention layer run again over the
  kept tokens (:class:`mlx_dspark.targets.adapter.RecurrentCache`);
- per-token states: the linear-attention layers step one token at a time in
  the verifying forward, keeping the state after each token, and the kept
  one is selected (no second pass).

Prints the mean time per round of each, interleaved, and their ratio.
"""

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import argparse
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import qwen3_5

from mlx_dspark.targets.adapter import RecurrentCache, TargetAdapter

ROUND = 8


def hybrid_target(hidden: int) -> qwen3_5.Model:
    heads = hidden // 64
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "num_hidden_layers": 8,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 4, 1),
        "head_dim": 64,
        "vocab_size": 4096,
        "linear_num_value_heads": heads,
        "linear_num_key_heads": max(heads // 2, 1),
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "full_attention_interval": 4,
        "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25},
    }
    model = qwen3_5.Model(
        qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text})
    )
    mx.eval(model.parameters())
    return model


def per_token_round(adapter, cache, tokens, keep) -> None:
    """Verify ``tokens`` with the linear-attention layers stepped one token at
    a time (the state after each kept), then keep ``keep`` tokens."""
    inner = adapter.inner
    h = inner.embed_tokens(tokens)
    states = {}
    for i, (layer, c) in enumerate(zip(inner.layers, cache, strict=True)):
        if isinstance(c, RecurrentCache):
            outs, states[i] = [], []
            for t in range(h.shape[1]):
                outs.append(layer(h[:, t : t + 1], None, c))
                states[i].append(list(c.cache))
            h = mx.concatenate(outs, axis=1)
        else:
            h = layer(h, "causal", c)
    mx.eval(inner.norm(h))
    for i, kept in states.items():
        cache[i].cache = kept[keep - 1]
    for c in cache:
        if not isinstance(c, RecurrentCache):
            c.trim(tokens.shape[1] - keep)
    mx.eval([c.state for c in cache])


def replay_round(adapter, cache, tokens, keep) -> None:
    logits, _ = adapter(tokens, cache)
    mx.eval(logits)
    adapter.rollback(cache, tokens.shape[1] - keep)
    mx.eval([c.state for c in cache])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    if args.rounds < 1 or args.hidden < 64 or args.hidden % 64:
        parser.error("--rounds must be >= 1 and --hidden a multiple of 64")
    model = hybrid_target(args.hidden)
    adapter = TargetAdapter(model)
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, 4096, (1, 256)))
    caches = {"replay": adapter.make_cache(), "per-token": adapter.make_cache()}
    for cache in caches.values():
        mx.eval(adapter(prompt, cache)[0])
    run = {"replay": replay_round, "per-token": per_token_round}
    times = {name: [] for name in run}
    for r in range(args.rounds):
        tokens = mx.array(rng.integers(0, 4096, (1, ROUND)))
        keep = int(rng.integers(1, ROUND + 1))
        for name in run if r % 2 == 0 else reversed(run):
            start = time.perf_counter()
            run[name](adapter, caches[name], tokens, keep)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name:>10}: {1e3 * np.mean(values):7.1f} ms per round")
    ratio = np.mean(times["per-token"]) / np.mean(times["replay"])
    print(
        f"per-token / replay: {ratio:.2f}x (hidden {args.hidden}, {mx.default_device()})"
    )


if __name__ == "__main__":
    main()
