"""Throughput and latency of mlx_dspark.server against mlx_lm.server, in one run.

For each pair (the default pair, the structured demo pair), each number of
concurrent clients and each server -- DSpark on (the batched engine with
Algorithm 1), DSpark off (the same server with ``--dspark-n-draft 0``, plain
batched decoding) and ``mlx_lm.server`` with the same target -- the clients
send ``--requests`` bounded greedy requests each over HTTP on 127.0.0.1, and
the script reports total generated tokens per second (the median of
``--trials`` runs, whose order rotates) and per-request latency.
Our two servers run in this process; ``mlx_lm.server`` runs as a child
process, started per pair on a free port (``import mlx_dspark`` first, so it
gets the same OpenBLAS). Each server answers one short warm-up request first.

Every reply of our servers is checked against the first reply to the same
prompt (greedy output is the same whatever the batch), so a lost or corrupted
reply fails the run; ``mlx_lm.server``'s replies are compared and counted
(its batched decoding need not be bit-identical). The demo pair's prompts are
sent as text (``"t1 t2 t3"``): ``mlx_lm.server`` hands any prompt to the
tokenizer's ``encode`` and answers token-id lists with HTTP 404.

    python examples/server_benchmark.py                  # both pairs, 1 2 4 8 clients
    python examples/server_benchmark.py --pairs demo --clients 1 2 --requests 1
    python examples/server_benchmark.py --pairs demo --clients 8 --requests 40 \\
        --max-tokens 16 --no-mlx-lm                      # a load test
"""

from __future__ import annotations

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

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
# Text for the demo pair's word-level tokenizer: "t7" is token 7.
DEMO_PROMPTS = ["t1 t2 t3", "t7 t8", "t20 t4 t11 t9", "t0", "t13 t5 t5 t21 t2 t17"]
MODES = ("dspark", "plain", "mlx_lm")
# Starts mlx_lm.server after mlx_dspark has loaded the system OpenBLAS.
MLX_LM_SERVER = (
    "import mlx_dspark, runpy, sys; sys.argv[0] = 'mlx_lm.server'; "
    "runpy.run_module('mlx_lm.server', run_name='__main__')"
)


def request(
    port: int, prompt: str, max_tokens: int, chat: bool
) -> tuple[str, int, float]:
    """One greedy request; returns (text, completion tokens, seconds)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    if chat:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=0.0)
    tic = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    elapsed = time.perf_counter() - tic
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {raw[:300]!r}")
    data = json.loads(raw)
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text or "", data["usage"]["completion_tokens"], elapsed


def run_clients(
    port: int, prompts: list[str], clients: int, requests: int, max_tokens: int, chat
) -> dict:
    """``clients`` threads, each sending ``requests`` prompts in turn."""
    latencies, tokens, errors, texts = [], [], [], []

    def client(c):
        for i in range(requests):
            prompt = prompts[(c + i * clients) % len(prompts)]
            try:
                text, n, elapsed = request(port, prompt, max_tokens, chat)
            except Exception as error:  # counted as lost
                errors.append(repr(error))
                continue
            texts.append((prompt, text))
            latencies.append(elapsed)
            tokens.append(n)

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    return {
        "tok_s": sum(tokens) / wall,
        "p50_s": statistics.median(latencies) if latencies else float("nan"),
        "max_s": max(latencies, default=float("nan")),
        "latencies": latencies,
        "requests": len(latencies),
        "errors": errors,
        "texts": texts,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlx_lm(target: str, port: int, log) -> subprocess.Popen:
    """``mlx_lm.server --model target`` on 127.0.0.1:port, once /health answers."""
    process = subprocess.Popen(
        [sys.executable, "-c", MLX_LM_SERVER, "--model", str(target)]
        + ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"mlx_lm.server exited with {process.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return process
        except OSError:
            pass
        time.sleep(0.5)
    stop_process(process)
    raise SystemExit("mlx_lm.server did not come up in 600 s")


def stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def load_pair(name: str, args):
    """``(model, tokenizer, drafter, target path for mlx_lm, prompts, chat)``."""
    from mlx_dspark.loading import load

    if name == "demo":
        from mlx_dspark.structured import demo_pair

        target, draft = demo_pair()
        prompts, chat = DEMO_PROMPTS, False
    elif args.model:
        target, draft = args.model, args.draft_model
        prompts, chat = PROMPTS, True
    else:
        from mlx_dspark.default import default_pair

        target, draft = default_pair()
        prompts, chat = PROMPTS, True
    model, tokenizer, drafter = load(target, draft)
    return model, tokenizer, drafter, target, prompts, chat


def serve_ours(
    model, tokenizer, drafter, num_draft, prior, args, prompts, chat, clients
):
    """One run of our server (a fresh engine, DSpark on or off) under the clients."""
    from mlx_dspark.serving import (
        BatchEngine,
        EngineConfig,
        ServerSettings,
        make_server,
    )

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
    port = server.server_address[1]
    try:
        request(port, prompts[0], 4, chat)  # warm-up
        result = run_clients(port, prompts, clients, args.requests,
                             args.max_tokens, chat)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
        engine.stop()
    result["mean_batch"] = engine.stats.mean_batch
    return result


def merge(runs: list[dict]) -> dict:
    """Trials of one mode: the median throughput, latencies and counts pooled."""
    latencies = [t for r in runs for t in r["latencies"]]
    merged = {
        "tok_s": statistics.median(r["tok_s"] for r in runs),
        "trials_tok_s": [round(r["tok_s"], 2) for r in runs],
        "p50_s": statistics.median(latencies) if latencies else float("nan"),
        "max_s": max(latencies, default=float("nan")),
        "latencies": latencies,
        "requests": sum(r["requests"] for r in runs),
        "errors": [e for r in runs for e in r["errors"]],
    }
    if "mean_batch" in runs[0]:
        merged["mean_batch"] = statistics.median(r["mean_batch"] for r in runs)
    if "same_as_dspark" in runs[0]:
        merged["same_as_dspark"] = sum(r["same_as_dspark"] for r in runs)
    return merged


def measure_pair(name: str, args, log) -> list[dict]:
    """Every client count: ``--trials`` rounds of the modes, in an order that
    rotates each trial (no mode always runs first, right after another's
    load), each mode's throughput the median of its trials."""
    from mlx_dspark.profile import load_profile

    model, tokenizer, drafter, target, prompts, chat = load_pair(name, args)
    prior = load_profile(model, drafter)
    modes = ["dspark", "plain"]
    mlx_lm = None
    if not args.no_mlx_lm:
        mlx_lm_port = free_port()
        mlx_lm = start_mlx_lm(target, mlx_lm_port, log)
        request(mlx_lm_port, prompts[0], 4, chat)  # warm-up
        modes.append("mlx_lm")
    replies: dict[str, str] = {}
    rows = []
    try:
        for clients in args.clients:
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for trial in range(args.trials):
                for mode in modes[trial % len(modes) :] + modes[: trial % len(modes)]:
                    if mode == "mlx_lm":
                        result = run_clients(mlx_lm_port, prompts, clients,
                                             args.requests, args.max_tokens, chat)  # fmt: skip
                    else:
                        num_draft = None if mode == "dspark" else 0
                        result = serve_ours(model, tokenizer, drafter, num_draft,
                                            prior, args, prompts, chat, clients)  # fmt: skip
                    if result["errors"]:
                        raise SystemExit(
                            f"{name} {mode} at {clients} clients: {result['errors'][:3]}"
                        )
                    runs[mode].append(result)
            for mode in ("dspark", "plain"):  # ours first: they define the replies
                for result in runs[mode]:
                    for prompt, text in result.pop("texts"):
                        if replies.setdefault(prompt, text) != text:
                            raise SystemExit(
                                f"{name} {mode} at {clients} clients: corrupted "
                                f"reply to {prompt[:40]!r}"
                            )
            for result in runs.get("mlx_lm", []):
                texts = result.pop("texts")
                result["same_as_dspark"] = sum(replies.get(p) == t for p, t in texts)
            row = {"pair": name, "clients": clients}
            row.update({mode: merge(runs[mode]) for mode in modes})
            rows.append(row)
            print(json.dumps(summary(row)), flush=True)
    finally:
        if mlx_lm is not None:
            stop_process(mlx_lm)
    return rows


def summary(row: dict) -> dict:
    """The row without the raw latency lists."""
    out = {"pair": row["pair"], "clients": row["clients"]}
    for mode in MODES:
        if mode in row:
            out[mode] = {k: v for k, v in row[mode].items() if k != "latencies"}
    return out


def print_table(rows: list[dict], args) -> None:
    modes = [m for m in MODES if m in rows[0]]
    names = {"dspark": "DSpark", "plain": "DSpark off", "mlx_lm": "`mlx_lm.server`"}
    header = ["pair", "clients"] + [f"{names[m]} tok/s (p50 s)" for m in modes]
    header += ["DSpark / off"] + (["DSpark / mlx_lm"] if "mlx_lm" in modes else [])
    header += ["mean batch"] + (["mlx_lm same text"] if "mlx_lm" in modes else [])
    print("\n| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        cells = [row["pair"], str(row["clients"])]
        cells += [f"{row[m]['tok_s']:.1f} ({row[m]['p50_s']:.2f})" for m in modes]
        cells.append(f"{row['dspark']['tok_s'] / row['plain']['tok_s']:.2f}x")
        if "mlx_lm" in modes:
            cells.append(f"{row['dspark']['tok_s'] / row['mlx_lm']['tok_s']:.2f}x")
        cells.append(f"{row['dspark']['mean_batch']:.2f}")
        if "mlx_lm" in modes:
            m = row["mlx_lm"]
            cells.append(f"{m['same_as_dspark']}/{m['requests']}")
        print("| " + " | ".join(cells) + " |")
    ours = sum(row[m]["requests"] for row in rows for m in ("dspark", "plain"))
    print(
        f"\n{ours} requests to our servers, none lost or corrupted (greedy replies "
        f"identical per prompt); {args.requests} per client, max_tokens "
        f"{args.max_tokens}, the median of {args.trials} trials."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pairs", nargs="+", choices=["default", "demo"], default=["default", "demo"]
    )
    parser.add_argument("--model", help="Target for 'default' (default: built-in).")
    parser.add_argument("--draft-model", help="DSpark drafter for --model.")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=2, help="Per client.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--trials", type=int, default=3, help="Runs of each mode (median reported)."
    )
    parser.add_argument(
        "--always-draft",
        action="store_true",
        help="DSpark mode drafts every step (no adaptive gate).",
    )
    parser.add_argument(
        "--no-mlx-lm", action="store_true", help="Skip the mlx_lm.server column."
    )
    parser.add_argument(
        "--mlx-lm-log",
        default=os.path.join(tempfile.gettempdir(), "mlx_lm_server.log"),
        help="Where mlx_lm.server's output goes.",
    )
    parser.add_argument("--json", help="Write every measurement here.")
    args = parser.parse_args()

    rows = []
    with open(args.mlx_lm_log, "w") as log:
        for name in args.pairs:
            rows += measure_pair(name, args, log)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
