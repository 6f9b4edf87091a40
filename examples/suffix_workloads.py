"""Suffix drafts on workloads users recognise, against mlx-lm alone.

    python examples/suffix_workloads.py [--model DIR] [--drafter] [--max-tokens 160]
        [--repeats 2] [--workloads edit,passage,chat,agent]

Greedy, one process, mlx-lm and ours interleaved prompt by prompt, both on the
BLAS ``mlx_dspark`` loads (OpenBLAS where the system has it; see
``mlx_dspark.doctor``). Without --model: the default pair's target
(SmolLM2-135M-Instruct, float32). With --drafter: the default pair's drafter too
(``stream_generate(model, tokenizer, drafter, ..., suffix=True)``); without it,
no drafter (``suffix=True``, ``drafter=None``). Each request starts from an
empty store (``suffix_store=None``): what is measured is what a request's own
text gives, not what earlier runs left.

Workloads, all text written here or taken from Python's standard library:

- edit: a standard-library function and an instruction to rename one of its
  parameters, the answer being the whole function again;
- passage: a standard-library module's documentation and a question answered
  from it;
- chat: plain questions;
- agent: a multi-turn tool-calling conversation (the same system prompt and
  JSON tool schema each turn, tool results fed back) sent to
  ``mlx_dspark.server --dspark-suffix`` over HTTP, twice: the second pass (an
  agent running the same task again) drafts from the first's answers in the
  server's global store. Prints each pass's decode rate (first streamed token
  to last) and wall time.

Prints, per workload, mlx-lm's and our tokens/s (medians over prompts and
repeats), the ratio, and whether every answer was token for token mlx-lm's.
"""

from __future__ import annotations

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import argparse
import inspect
import json
import socket
import statistics
import subprocess
import sys
import textwrap
import time
import urllib.request

import mlx.core as mx
from mlx_lm.generate import generate_step

WORKLOADS = ("edit", "passage", "chat", "agent")


def edit_prompts() -> list[str]:
    import shlex

    out = []
    for function, old, new in (
        (textwrap.indent, "prefix", "margin"),
        (textwrap.shorten, "width", "limit"),
        (shlex.split, "comments", "keep_comments"),
    ):
        source = textwrap.dedent(inspect.getsource(function))
        out.append(
            "Here is a Python function:\n\n" + source + f"\nRename the parameter "
            f"`{old}` to `{new}`. Reply with the whole function and nothing else."
        )
    return out


def passage_prompts() -> list[str]:
    import json as json_module
    import shlex

    out = []
    for module, question in (
        (shlex, "Which functions does this module provide, and what does each do?"),
        (json_module, "Summarise what this module is for and how to use it."),
        (textwrap, "What does this module offer? Answer from the text above."),
    ):
        passage = inspect.getdoc(module) or ""
        out.append(f"Read this documentation:\n\n{passage}\n\n{question}")
    return out


def chat_prompts() -> list[str]:
    return [
        "Write a short story about a lighthouse keeper who finds a message.",
        "What are three good habits for staying focused while working from home?",
        "Explain why the sky is blue to a ten-year-old.",
    ]


TOOLS = [
    {
        "name": "read_file",
        "description": "Read a text file of the project.",
        "parameters": {"path": "string"},
    },
    {
        "name": "search",
        "description": "Search the project's files for a word.",
        "parameters": {"query": "string"},
    },
]
AGENT_SYSTEM = (
    "You are a coding agent working in a Python project. You can call tools. "
    "To call one, reply with only a JSON object "
    '{"tool": NAME, "arguments": {...}} and nothing else. The tools:\n'
    + json.dumps(TOOLS, indent=2)
    + "\nWhen you have the answer, reply in plain text."
)
AGENT_TURNS = [
    "Find where the project defines its command-line parser.",
    'Tool result: {"matches": ["cli/main.py:12: def build_parser()"]}',
    "Read that file and tell me which options the parser accepts.",
    'Tool result: {"text": "parser.add_argument(\\"--model\\")\\n'
    'parser.add_argument(\\"--max-tokens\\", type=int)"}',
    "Summarise what you found in two sentences.",
]


def rendered(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    return tokenizer.encode(text)


def alone(model, prompt, max_tokens, eos) -> tuple[list[int], float]:
    tic = time.perf_counter()
    tokens = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(t))
        if tokens[-1] in eos:
            break
    return tokens, len(tokens) / (time.perf_counter() - tic)


def ours(model, tokenizer, drafter, prompt, max_tokens) -> tuple[list[int], float]:
    tic = time.perf_counter()
    responses = list(
        mlx_dspark.stream_generate(
            model,
            tokenizer,
            drafter,
            prompt,
            max_tokens=max_tokens,
            suffix=True,
            suffix_store=None,
        )
    )
    tokens = [r.token for r in responses]
    return tokens, len(tokens) / (time.perf_counter() - tic)


def local(args, model, tokenizer, drafter, name, texts) -> None:
    eos = set(tokenizer.eos_token_ids)
    prompts = [rendered(tokenizer, t) for t in texts]
    ours(model, tokenizer, drafter, prompts[0], 8)  # warm up (profile, compile)
    rates = {"mlx-lm": [], "ours": []}
    same = True
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = ("mlx-lm", "ours") if (i + repeat) % 2 else ("ours", "mlx-lm")
            got = {}
            for who in order:
                if who == "mlx-lm":
                    got[who], rate = alone(model, prompt, args.max_tokens, eos)
                else:
                    got[who], rate = ours(
                        model, tokenizer, drafter, prompt, args.max_tokens
                    )
                rates[who].append(rate)
            mine, expected = (
                t[:-1] if t and t[-1] in eos else t
                for t in (got["ours"], got["mlx-lm"])
            )
            same &= mine == expected
    base, mine = statistics.median(rates["mlx-lm"]), statistics.median(rates["ours"])
    print(
        f"{name:8s} mlx-lm {base:6.1f} tok/s  ours {mine:6.1f} tok/s  "
        f"{mine / base:.2f}x  identical: {same}",
        flush=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps(
        {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        body,
        {"Content-Type": "application/json"},
    )
    tic = time.perf_counter()
    first = last = None
    text, chunks = "", 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if delta.get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                text += delta["content"]
                chunks += 1
    done = time.perf_counter()
    return {"text": text, "wall": done - tic, "decode": (last or done) - (first or tic)}


def agent(args, model_dir: str) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "mlx_dspark.server",
        "--model",
        model_dir,
        "--dspark-suffix",
        "--port",
        str(port),
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        from mlx_lm import load as mlx_lm_load

        _, tokenizer = mlx_lm_load(model_dir)
        passes = []
        answers = None
        for _ in range(2):
            messages = [{"role": "system", "content": AGENT_SYSTEM}]
            wall = decode = 0.0
            tokens = 0
            texts = []
            for turn in AGENT_TURNS:
                messages.append({"role": "user", "content": turn})
                reply = stream_chat(port, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": reply["text"]})
                texts.append(reply["text"])
                wall += reply["wall"]
                decode += reply["decode"]
                tokens += len(tokenizer.encode(reply["text"]))
            passes.append((wall, tokens / max(decode, 1e-9)))
            same = answers is None or answers == texts
            answers = texts
        (w1, r1), (w2, r2) = passes
        print(
            f"agent    pass 1: {w1:5.1f} s, decode {r1:5.1f} tok/s; pass 2: "
            f"{w2:5.1f} s, decode {r2:5.1f} tok/s; pass 2 {w1 / w2:.2f}x faster "
            f"(decode {r2 / r1:.2f}x); same answers: {same}",
            flush=True,
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: SmolLM2)")
    parser.add_argument(
        "--drafter", action="store_true", help="with the default pair's drafter"
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    chosen = args.workloads.split(",")
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {WORKLOADS}.")
    from mlx_dspark.pairs.default import default_pair

    target, drafter_path = default_pair()
    model_dir = str(args.model or target)
    if args.drafter:
        if args.model:
            parser.error("--drafter is the default pair's: leave out --model.")
        model, tokenizer, drafter = mlx_dspark.load(model_dir, str(drafter_path))
    else:
        model, tokenizer, drafter = mlx_dspark.load(model_dir)
    print(f"target {model_dir}, drafter: {'default' if args.drafter else 'none'}")
    texts = {"edit": edit_prompts, "passage": passage_prompts, "chat": chat_prompts}
    for name in chosen:
        if name == "agent":
            if args.drafter:
                print("agent    (served with suffix drafts and no drafter only)")
                continue
            agent(args, model_dir)
        else:
            local(args, model, tokenizer, drafter, name, texts[name]())


if __name__ == "__main__":
    main()
