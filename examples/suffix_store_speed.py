"""How fast the suffix store indexes, appends and proposes, on real token
streams (CPython's standard library sources).

    python examples/suffix_store_speed.py [--tokenizer tokenizer.json]
        [--phrases mlx_dspark/assets/default_drafter/phrases.npy]
        [--arctic DIR]

Tokens come from a ``tokenizer.json`` (the ``tokenizers`` package; by
default the SmolLM2 one in the user cache if it is there), else from a
byte-level encoding (one token per byte, vocabulary 256: more matches, so a
harder case for the store). Workloads, as a decoding loop would drive them:

- re-emission: a 20k-token prompt of source files, and an output copying one
  of them (long matches, one occurrence each);
- fresh text: the same prompt, and an output from files not in it (short
  matches, many occurrences);
- global: the shipped phrase store plus ~200 other stdlib files as earlier
  responses, then the fresh-text output proposed against both indexes.

Each output token is appended, then a chain and a tree (16 nodes) proposed.
``--arctic DIR`` also times ArcticInference's C++ suffix tree (its ``_C``
extension built from the sdist's ``csrc/suffix_decoding``, placed in DIR) on
the same streams.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from mlx_dspark.proposers import suffix_store as ss

DEFAULT_TOKENIZER = (
    Path.home() / ".cache/mlx_dspark/smollm2-135m-instruct-f32/tokenizer.json"
)
PHRASES = Path(__file__).parents[1] / "mlx_dspark/assets/default_drafter/phrases.npy"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    return files


def encoder(tokenizer: str | None):
    if tokenizer and Path(tokenizer).exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
        return f"tokenizer {tokenizer}", lambda text: tok.encode(text).ids
    return "bytes (one token per byte)", lambda text: list(text.encode())


def stats(seconds: list) -> str:
    """Single-shot and best-of-3 figures: on a shared machine single shots
    include other processes' time slices."""
    ms = np.array(seconds) * 1e3
    if ms.ndim == 1:
        ms = ms[:, None]
    one, best = ms[:, 0], ms.min(axis=1)
    return (
        f"median {np.median(one):.3f} ms, p90 {np.percentile(one, 90):.3f} ms; "
        f"best of {ms.shape[1]}: median {np.median(best):.3f}, "
        f"p90 {np.percentile(best, 90):.3f}, max {best.max():.3f} ms "
        f"({ms.shape[0]} calls)"
    )


def timed(call, repeats: int = 3):
    """The result of ``call()`` and the seconds of each of ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - t)
    return result, times


def decode_loop(ss, prompt, output, store, config):
    """Index the prompt, then per output token: append, propose a chain and a
    tree. Returns the times and the mean draft lengths."""
    t = time.perf_counter()
    request = ss.SuffixRequest(prompt, store, config)
    index_s = time.perf_counter() - t
    append, chain, tree, sizes = [], [], [], [0, 0]
    for token in output:
        t = time.perf_counter()
        request.append(int(token))
        append.append(time.perf_counter() - t)
        draft, times = timed(lambda: request.propose(tree=False))
        chain.append(times)
        sizes[0] += len(draft)
        draft, times = timed(lambda: request.propose(tree=True, max_tokens=16))
        tree.append(times)
        sizes[1] += len(draft)
    request.close()
    return index_s, append, chain, tree, [s / len(output) for s in sizes]


def arctic_loop(module, prompt, output, global_tree):
    t = time.perf_counter()
    local = module.SuffixTree(64)
    local.extend(0, [int(x) for x in prompt])
    index_s = time.perf_counter() - t
    context = [int(x) for x in prompt]
    chain, tree, append = [], [], []
    seq = 1_000_000
    for token in output:
        t = time.perf_counter()
        local.extend(0, [int(token)])
        if global_tree is not None:
            global_tree.extend(seq, [int(token)])
        append.append(time.perf_counter() - t)
        context.append(int(token))
        for use_tree, out in ((False, chain), (True, tree)):

            def call(use_tree=use_tree):
                ctx = context[-64:]
                a = local.speculate(ctx, 16, 1.0, 0.0, 0.1, use_tree)
                if global_tree is not None:
                    b = global_tree.speculate(ctx, 16, 1.0, 0.0, 0.1, use_tree)
                    a = a if a.score >= b.score else b
                return a

            out.append(timed(call)[1])
    return index_s, append, chain, tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    parser.add_argument("--phrases", default=str(PHRASES))
    parser.add_argument("--prompt-tokens", type=int, default=20_000)
    parser.add_argument("--output-tokens", type=int, default=400)
    parser.add_argument("--arctic", help="folder holding ArcticInference's _C")
    args = parser.parse_args()
    name, encode = encoder(args.tokenizer)
    files = stdlib_files()
    print(f"tokens: {name}; {len(files)} stdlib files")

    streams, total = [], 0
    t = time.perf_counter()
    for path in files[:400]:
        ids = np.array(encode(path.read_text(errors="replace")), np.int32)
        streams.append(ids)
        total += ids.size
    print(f"encoded {total} tokens in {time.perf_counter() - t:.1f} s")
    prompt_parts, n, i = [], 0, 0
    while n < args.prompt_tokens:
        prompt_parts.append(streams[i][: args.prompt_tokens - n])
        n += prompt_parts[-1].size
        i += 1
    prompt = np.concatenate(prompt_parts)
    copied = prompt_parts[len(prompt_parts) // 2][: args.output_tokens]
    fresh = streams[i][: args.output_tokens]
    others = streams[i + 1 :]
    config = ss.SuffixConfig(max_draft=16)
    print(f"prompt {prompt.size} tokens; outputs {copied.size} tokens")

    t = time.perf_counter()
    ss.SuffixIndex(prompt)
    print(
        f"\nindex a {prompt.size}-token prompt: {(time.perf_counter() - t) * 1e3:.3f} ms"
    )
    for label, output, store in (
        ("re-emission", copied, None),
        ("fresh text", fresh, None),
    ):
        index_s, append, chain, tree, sizes = decode_loop(
            ss, prompt, output, store, config
        )
        print(f"\n[{label}, request index only] index {index_s * 1e3:.3f} ms")
        print(f"  append: {stats(append)}")
        print(f"  chain:  {stats(chain)}; mean draft {sizes[0]:.1f} tokens")
        print(f"  tree:   {stats(tree)}; mean draft {sizes[1]:.1f} nodes")

    store = ss.SuffixStore(max_tokens=4_000_000)
    if Path(args.phrases).exists() and "SmolLM2" not in name and "smollm2" not in name:
        print("\n(phrase store skipped: its ids are SmolLM2's, not these tokens')")
    elif Path(args.phrases).exists():
        t = time.perf_counter()
        count = store.add_phrases(args.phrases)
        print(
            f"\nload phrases.npy: {count} documents, {store.num_tokens} tokens in "
            f"{(time.perf_counter() - t) * 1e3:.0f} ms"
        )
    t = time.perf_counter()
    store.add_documents(others)
    print(
        f"add {len(others)} stdlib files as documents: {store.num_tokens} tokens "
        f"stored, {(time.perf_counter() - t) * 1e3:.0f} ms"
    )
    t = time.perf_counter()
    for doc in others[:20]:
        store.add_document(doc)
    per = (time.perf_counter() - t) / sum(d.size for d in others[:20])
    print(
        f"add 20 documents one by one (pending, freezes, merges): {per * 1e6:.2f} us/token"
    )
    index_s, append, chain, tree, sizes = decode_loop(ss, prompt, fresh, store, config)
    print(f"\n[fresh text, request + global ({store.num_tokens} tokens)]")
    print(f"  append: {stats(append)}")
    print(f"  chain:  {stats(chain)}; mean draft {sizes[0]:.1f} tokens")
    print(f"  tree:   {stats(tree)}; mean draft {sizes[1]:.1f} nodes")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "suffix.npz"
        t = time.perf_counter()
        store.save(path, name)
        saved = time.perf_counter() - t
        t = time.perf_counter()
        ss.SuffixStore.load(path, name, max_tokens=4_000_000)
        loaded = time.perf_counter() - t
        print(
            f"\nsave {path.stat().st_size / 1e6:.1f} MB: {saved * 1e3:.0f} ms; "
            f"load (and sort): {loaded * 1e3:.0f} ms"
        )

    if args.arctic:
        sys.path.insert(0, args.arctic)
        module = importlib.import_module("_C")
        print("\nArcticInference C++ suffix tree (depth 64, same streams):")
        for label, output in (("re-emission", copied), ("fresh text", fresh)):
            index_s, append, chain, tree = arctic_loop(module, prompt, output, None)
            print(f"[{label}, request tree only] index {index_s * 1e3:.1f} ms")
            print(f"  append: {stats(append)}")
            print(f"  chain:  {stats(chain)}")
            print(f"  tree:   {stats(tree)}")
        t = time.perf_counter()
        global_tree = module.SuffixTree(64)
        for seq, doc in enumerate(others):
            global_tree.extend(seq, [int(x) for x in doc])
        print(
            f"global tree of {sum(d.size for d in others)} tokens built in "
            f"{(time.perf_counter() - t) * 1e3:.0f} ms"
        )
        index_s, append, chain, tree = arctic_loop(module, prompt, fresh, global_tree)
        print("[fresh text, request + global]")
        print(f"  append: {stats(append)}")
        print(f"  chain:  {stats(chain)}")
        print(f"  tree:   {stats(tree)}")


if __name__ == "__main__":
    main()
