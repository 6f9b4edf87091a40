"""Prompt reuse and throughput of mlx_dspark.server beside mlx_lm.server, one run.

Both servers run as child processes on 127.0.0.1, one at a time, with the same
model, the same requests and the same OpenBLAS (``mlx_lm.server`` is started
after ``import mlx_dspark``, which loads the system OpenBLAS before
``mlx.core``, see ``mlx_dspark/blas.py``). Greedy requests throughout.

(a) ``ttft``: a conversation whose system prompt is ~``--system-tokens``
    tokens (CPython's ``textwrap.py`` source, cut to that many tokens of the
    target's tokenizer). Turn 1 is [system, user]; turn 2 adds the answer and
    a second user message. Each turn is a streamed request; the time to first
    token is the time to the first chunk with text. Every server starts with
    an empty prompt cache and answers one short completion first (one-time
    costs). Targets: the default pair (SmolLM2-135M-Instruct
    with the shipped drafter) and ``gemma3-270m``'s target (sliding window
    512 on five layers of six; served here with suffix drafts, since its
    drafter is trained by a recipe, not installed).
(b) ``throughput``: ``--clients`` concurrent clients, each sending
    ``--requests`` short chat requests of ``--max-tokens`` tokens; total
    generated tokens per second (median of ``--trials`` server runs, in the
    order ours, theirs, theirs, ours...), our server with the default pair's
    drafter against ``mlx_lm.server`` (the default target only). Each server
    run answers a few requests first.

    python examples/server_vs_mlx_lm.py
    python examples/server_vs_mlx_lm.py --parts ttft --targets default

``cached`` is the servers' own ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import argparse
import http.client
import inspect
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from server_benchmark import (
    MLX_LM_SERVER,
    PROMPTS,
    free_port,
    run_clients,
    start_server,
    stop_process,
)

USER_1 = "Review this module: what are its three most important functions?"
USER_2 = "Which of them would you test first, and why?"


def system_prompt(target: Path, tokens: int) -> str:
    """``textwrap.py``'s source cut to ``tokens`` tokens of the target's
    tokenizer."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(target)
    source = inspect.getsource(textwrap)
    while len(tokenizer.encode(source)) < tokens:
        source += "\n" + source
    ids = tokenizer.encode(source, add_special_tokens=False)[:tokens]
    return "You are a careful code reviewer.\n\n" + tokenizer.decode(ids)


def streamed(port: int, messages: list[dict], max_tokens: int) -> tuple:
    """(seconds to the first text chunk, text, cached prompt tokens)."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    tic = time.perf_counter()
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first, text, cached = None, "", None
    for line in response:
        line = line.strip()
        if not line.startswith(b"data: {"):
            continue
        data = json.loads(line[6:])
        for choice in data.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - tic
            text += piece
        usage = data.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    conn.close()
    return first, text, cached


def blas_of(process) -> str:
    """The OpenBLAS a server process maps, or "reference" (MLX's own)."""
    maps = Path(f"/proc/{process.pid}/maps").read_text()
    found = sorted(
        {line.split()[-1] for line in maps.splitlines() if "openblas" in line}
    )
    return ", ".join(found) or "reference"


def command(server: str, target: Path, port: int, drafter: str | None) -> list:
    address = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    if server == "mlx_lm":
        return [sys.executable, "-c", MLX_LM_SERVER, "--model", str(target), *address]
    ours = [sys.executable, "-m", "mlx_dspark.server", *address]
    if drafter == "default":
        return ours  # the default pair, with its drafter
    return [*ours, "--model", str(target), "--dspark-suffix"]


def ttft(name: str, target: Path, drafter, args, log, blas: dict) -> list[str]:
    system = system_prompt(target, args.system_tokens)
    rows = []
    for server in ("mlx_dspark", "mlx_lm"):
        port = free_port()
        process = start_server(
            command(server, target, port, drafter), server, port, log
        )
        blas[server] = blas_of(process)
        try:
            # One-time costs out of turn 1: a short completion first.
            run_clients(port, ["Hello"], 1, 1, 2, False)
            history = [
                {"role": "system", "content": system},
                {"role": "user", "content": USER_1},
            ]
            t1, answer, c1 = streamed(port, history, args.turn_tokens)
            history += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": USER_2},
            ]
            t2, _, c2 = streamed(port, history, args.turn_tokens)
        finally:
            stop_process(process)
        rows.append(
            f"| {name} | {server} | {t1:.2f} | {c1} | {t2:.2f} | {c2} "
            f"| {100 * t2 / t1:.1f}% |"
        )
        print(rows[-1], flush=True)
    return rows


def throughput(target: Path, args, log, blas: dict) -> list[str]:
    """Generated tokens/s per server and number of clients: the median over
    ``--trials`` server runs, in the order ours, theirs, theirs, ours, ...
    (a machine that speeds up or slows down favours neither)."""
    results: dict = {}
    order = []
    for trial in range(args.trials):
        pair = ["mlx_dspark", "mlx_lm"]
        order += pair if trial % 2 == 0 else pair[::-1]
    for server in order:
        port = free_port()
        process = start_server(
            command(server, target, port, "default"), server, port, log
        )
        blas[server] = blas_of(process)
        try:
            # Warm-up: one request, then a few together.
            run_clients(port, PROMPTS[:1], 1, 1, args.max_tokens, True)
            run_clients(port, PROMPTS, 4, 1, 4, True)
            for clients in args.clients:
                got = run_clients(
                    port, PROMPTS, clients, args.requests, args.max_tokens, True
                )
                if got["errors"]:
                    raise SystemExit(f"{server}: {got['errors'][:2]}")
                results.setdefault((server, clients), []).append(got["tok_s"])
        finally:
            stop_process(process)
    rows = []
    for clients in args.clients:
        ours = statistics.median(results["mlx_dspark", clients])
        theirs = statistics.median(results["mlx_lm", clients])
        rows.append(f"| {clients} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["ttft", "throughput"])
    parser.add_argument("--targets", nargs="+", default=["default", "gemma3"])
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()

    from mlx_dspark.pairs.default import target_dir as default_target

    blas: dict[str, str] = {}
    with tempfile.TemporaryFile("w+") as log:
        if "ttft" in args.parts:
            print("\n(a) time to first token, seconds (streamed, greedy)\n")
            print("| target | server | turn 1 | cached | turn 2 | cached | 2 / 1 |")
            print("|---|---|---|---|---|---|---|")
            for name in args.targets:
                if name == "default":
                    ttft("SmolLM2-135M", default_target(), "default", args, log, blas)
                else:
                    from mlx_dspark.pairs.gemma3 import target_dir as gemma

                    ttft("Gemma-3-270M", gemma(), None, args, log, blas)
        if "throughput" in args.parts:
            print(
                f"\n(b) generated tokens/s, SmolLM2-135M, {args.requests} requests "
                f"of {args.max_tokens} tokens per client, median of "
                f"{args.trials} runs\n"
            )
            print("| clients | mlx_dspark (default drafter) | mlx_lm.server | ratio |")
            print("|---|---|---|---|")
            throughput(default_target(), args, log, blas)
    for server, library in blas.items():
        print(f"BLAS of {server}: {library}")


if __name__ == "__main__":
    main()
