"""Throughput and latency of mlx_dspark.server against mlx_lm.server, in one run.

For each pair (the default pair, the structured demo pair), each number of
concurrent clients and each server -- DSpark on (the batched engine with
Algorithm 1), DSpark off (the same server with ``--dspark-n-draft 0``, plain
batched decoding) and ``mlx_lm.server`` with the same target -- the clients
send ``--requests`` bounded greedy requests each over HTTP on 127.0.0.1, and
the script reports total generated tokens per second (the median of
``--trials`` runs, whose order rotates) and per-request latency.
Every server runs as its own child process, as people run them, started once
per pair on a free port and kept for every client count and trial (our
``mlx_dspark.server`` twice: with its defaults and with ``--dspark-n-draft
0``; ``mlx_lm.server`` after ``import mlx_dspark``, so it gets the same
OpenBLAS), so the clients' threads here never share a process with a server.
Each server answers one short warm-up request first. The mean batch (requests
verified per target forward) comes from our servers' ``/metrics``.

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
    python examples/server_benchmark.py --pairs default --clients 4 8 \\
        --no-cache-column                                # what the prompt cache gives

``--no-cache-column`` adds DSpark off with ``--prompt-cache-size 0`` as a
fourth server, in the same rotation.
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
MODES = ("dspark", "plain", "plain_no_cache", "mlx_lm")
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


def start_server(command: list[str], name: str, port: int, log) -> subprocess.Popen:
    """``command`` (a server listening on 127.0.0.1:port), once /health answers."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with {process.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return process
        except OSError:
            pass
        time.sleep(0.5)
    stop_process(process)
    raise SystemExit(f"{name} did not come up in 600 s")


def server_command(mode: str, target: str, draft: str, port: int, args) -> list[str]:
    address = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    if mode == "mlx_lm":
        return [sys.executable, "-c", MLX_LM_SERVER, "--model", str(target), *address]
    command = [sys.executable, "-m", "mlx_dspark.server", "--model", str(target),
               "--draft-model", str(draft), "--decode-concurrency",
               str(max(args.clients)), *address]  # fmt: skip
    if mode in ("plain", "plain_no_cache"):
        command += ["--dspark-n-draft", "0"]
    if mode == "plain_no_cache":
        command += ["--prompt-cache-size", "0"]
    elif args.always_draft:
        command.append("--no-dspark-adaptive")
    return command


def batch_counters(port: int) -> tuple[float, float]:
    """Our server's (target forwards, request rounds) so far, from /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    values = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    conn.close()
    return (
        values["dspark_server_target_forwards_total"],
        values["dspark_server_request_rounds_total"],
    )


def stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def pair_paths(name: str, args) -> tuple[str, str, list[str], bool]:
    """``(target, drafter, prompts, chat)`` of a pair."""
    if name == "demo":
        from mlx_dspark.pairs.structured import demo_pair

        target, draft = demo_pair()
        return str(target), str(draft), DEMO_PROMPTS, False
    if args.model:
        return args.model, args.draft_model, PROMPTS, True
    from mlx_dspark.pairs.default import default_pair

    target, draft = default_pair()
    return str(target), str(draft), PROMPTS, True


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
    target, draft, prompts, chat = pair_paths(name, args)
    modes = ["dspark", "plain"] + (["plain_no_cache"] if args.no_cache_column else [])
    modes += [] if args.no_mlx_lm else ["mlx_lm"]
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    replies: dict[str, str] = {}
    rows = []
    try:
        for mode in modes:
            port = free_port()
            command = server_command(mode, target, draft, port, args)
            servers[mode] = (start_server(command, mode, port, log), port)
            request(port, prompts[0], 4, chat)  # warm-up
        for clients in args.clients:
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for trial in range(args.trials):
                for mode in modes[trial % len(modes) :] + modes[: trial % len(modes)]:
                    port = servers[mode][1]
                    before = None if mode == "mlx_lm" else batch_counters(port)
                    result = run_clients(port, prompts, clients, args.requests,
                                         args.max_tokens, chat)  # fmt: skip
                    if before is not None:
                        forwards, rounds = batch_counters(port)
                        result["mean_batch"] = (rounds - before[1]) / max(
                            forwards - before[0], 1.0
                        )
                    if result["errors"]:
                        raise SystemExit(
                            f"{name} {mode} at {clients} clients: {result['errors'][:3]}"
                        )
                    runs[mode].append(result)
            ours = [m for m in modes if m != "mlx_lm"]
            for mode in ours:  # they define the replies
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
        for process, _ in servers.values():
            stop_process(process)
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
    names = {"dspark": "DSpark", "plain": "DSpark off",
             "plain_no_cache": "off, no prompt cache", "mlx_lm": "`mlx_lm.server`"}  # fmt: skip
    header = ["pair", "clients"] + [f"{names[m]} tok/s (p50 s)" for m in modes]
    header += ["DSpark / off"] + (["DSpark / mlx_lm"] if "mlx_lm" in modes else [])
    header += ["off / no cache"] if "plain_no_cache" in modes else []
    header += ["mean batch"] + (["mlx_lm same text"] if "mlx_lm" in modes else [])
    print("\n| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        cells = [row["pair"], str(row["clients"])]
        cells += [f"{row[m]['tok_s']:.1f} ({row[m]['p50_s']:.2f})" for m in modes]
        cells.append(f"{row['dspark']['tok_s'] / row['plain']['tok_s']:.2f}x")
        if "mlx_lm" in modes:
            cells.append(f"{row['dspark']['tok_s'] / row['mlx_lm']['tok_s']:.2f}x")
        if "plain_no_cache" in modes:
            ratio = row["plain"]["tok_s"] / row["plain_no_cache"]["tok_s"]
            cells.append(f"{ratio:.2f}x")
        cells.append(f"{row['dspark']['mean_batch']:.2f}")
        if "mlx_lm" in modes:
            m = row["mlx_lm"]
            cells.append(f"{m['same_as_dspark']}/{m['requests']}")
        print("| " + " | ".join(cells) + " |")
    ours = sum(row[m]["requests"] for row in rows for m in modes if m != "mlx_lm")
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
        "--no-cache-column",
        action="store_true",
        help="Also run DSpark off with --prompt-cache-size 0.",
    )
    parser.add_argument(
        "--server-log",
        default=os.path.join(tempfile.gettempdir(), "server_benchmark.log"),
        help="Where the servers' output goes.",
    )
    parser.add_argument("--json", help="Write every measurement here.")
    args = parser.parse_args()

    rows = []
    with open(args.server_log, "w") as log:
        for name in args.pairs:
            rows += measure_pair(name, args, log)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
