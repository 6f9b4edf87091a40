"""Throughput and latency of mlx_dspark.server at 1, 2, 4, 8 concurrent clients.

For each concurrency and mode (DSpark on: the batched engine with Algorithm 1;
DSpark off: the same server with ``--dspark-n-draft 0``, plain batched
decoding) the script starts an in-process server on 127.0.0.1, runs the
clients over HTTP (each sends ``--requests`` bounded greedy completions), and
reports total generated tokens per second and per-request latency. Every
reply is checked against the first reply to the same prompt (greedy output
is the same whatever the batch), so a lost or corrupted reply fails the run.
``--mlx-lm-url`` adds a column for an ``mlx_lm.server`` started by hand with
the same target (``mlx_lm.server --model T --port 8081``).

    python examples/server_benchmark.py                  # the default pair
    python examples/server_benchmark.py --demo           # the structured demo pair
    python examples/server_benchmark.py --clients 1 2 4 8 --requests 4 --max-tokens 128
    python examples/server_benchmark.py --clients 8 --requests 40   # a load test
"""

from __future__ import annotations

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import argparse
import http.client
import json
import statistics
import threading
import time
from urllib.parse import urlparse

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "List five tips for learning a new language.",
    "Describe the water cycle in simple words.",
    "What makes a good cup of coffee?",
    "Summarize the rules of chess.",
    "Write a poem about autumn leaves.",
    "How do airplanes stay in the air?",
]
DEMO_PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 11, 9], [0], [13, 5, 5, 21, 2, 17]]


def request(host: str, port: int, prompt, max_tokens: int) -> tuple[str, int, float]:
    conn = http.client.HTTPConnection(host, port, timeout=600)
    if isinstance(prompt, str):
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=0.0)
    tic = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    elapsed = time.perf_counter() - tic
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data}")
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text or "", data["usage"]["completion_tokens"], elapsed


def run_clients(host, port, prompts, clients, requests, max_tokens, replies):
    """``clients`` threads, each sending ``requests`` prompts in turn."""
    latencies, tokens, errors = [], [], []

    def client(c):
        for i in range(requests):
            prompt = prompts[(c + i * clients) % len(prompts)]
            try:
                text, n, elapsed = request(host, port, prompt, max_tokens)
            except Exception as error:  # counted as lost
                errors.append(repr(error))
                continue
            key = json.dumps(prompt)
            first = replies.setdefault(key, text)
            if first != text:
                errors.append(f"corrupted reply to {key[:40]}")
            latencies.append(elapsed)
            tokens.append(n)

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    return sum(tokens) / wall, latencies, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Target (default: the built-in default pair).")
    parser.add_argument("--draft-model", help="DSpark drafter for --model.")
    parser.add_argument("--demo", action="store_true", help="The structured demo pair.")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=2, help="Per client.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--always-draft",
        action="store_true",
        help="DSpark mode drafts every step (no adaptive gate).",
    )
    parser.add_argument(
        "--mlx-lm-url", help="An mlx_lm.server to compare, e.g. http://127.0.0.1:8081"
    )
    args = parser.parse_args()

    from mlx_dspark.loading import load
    from mlx_dspark.profile import load_profile
    from mlx_dspark.serving import (
        BatchEngine,
        EngineConfig,
        ServerSettings,
        make_server,
    )

    if args.demo:
        from mlx_dspark.structured import demo_pair

        model, tokenizer, drafter = load(*demo_pair())
        prompts = DEMO_PROMPTS
    else:
        model, tokenizer, drafter = load(args.model, args.draft_model)
        prompts = PROMPTS
    prior = load_profile(model, drafter)
    replies: dict[str, str] = {}
    rows = []
    for clients in args.clients:
        row = {"clients": clients}
        for mode, num_draft in (("dspark", None), ("plain", 0)):
            engine = BatchEngine(
                model,
                tokenizer,
                drafter,
                EngineConfig(
                    num_draft=num_draft,
                    max_batch=max(args.clients),
                    prior=prior,
                    adaptive=not args.always_draft,
                ),
            )
            server = make_server(engine, tokenizer, ServerSettings(), port=0)
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            try:
                tps, latencies, errors = run_clients(
                    "127.0.0.1",
                    server.server_address[1],
                    prompts,
                    clients,
                    args.requests,
                    args.max_tokens,
                    replies,
                )
            finally:
                server.shutdown()
                server.server_close()
                engine.stop()
            if errors:
                raise SystemExit(f"{mode} at {clients} clients: {errors[:3]}")
            row[mode] = (tps, statistics.median(latencies), engine.stats.mean_batch)
        if args.mlx_lm_url:
            url = urlparse(args.mlx_lm_url)
            tps, latencies, errors = run_clients(
                url.hostname,
                url.port,
                prompts,
                clients,
                args.requests,
                args.max_tokens,
                {},
            )
            if errors or not latencies:
                raise SystemExit(f"mlx_lm at {clients} clients: {errors[:3]}")
            row["mlx_lm"] = (tps, statistics.median(latencies), float("nan"))
        rows.append(row)
        print(row, flush=True)

    modes = ["dspark", "plain"] + (["mlx_lm"] if args.mlx_lm_url else [])
    print()
    print(
        "| clients | "
        + " | ".join(f"{m} tok/s | {m} p50 s" for m in modes)
        + " | dspark/plain |"
    )
    print("|---" * (2 + 2 * len(modes)) + "|")
    for row in rows:
        cells = [f"{row[m][0]:.1f} | {row[m][1]:.2f}" for m in modes]
        ratio = row["dspark"][0] / row["plain"][0]
        print(f"| {row['clients']} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    total = sum(args.requests * c for c in args.clients) * 2
    print(
        f"\n{total} requests, none lost or corrupted (greedy replies identical per prompt)."
    )


if __name__ == "__main__":
    main()
