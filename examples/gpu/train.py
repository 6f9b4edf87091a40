"""Step 2 of the GPU route (on the device, PyTorch, no MLX): data and training.

The device takes one folder of at most 64 MiB a call, so the target travels
in two: the first call stashes ``part-a`` on the machine, the second brings
``part-b`` and runs (within 30 s, while the machine is still warm)::

    python3 examples/gpu/train.py --stash .gpu/part-a
    python3 examples/gpu/train.py --parts /tmp/gpu-stash/part-a,.gpu/part-b \\
        --data .gpu/data --out $OUT --budget 520

The run, every phase bounded by wall-clock seconds from its start:

1. the target writes its own user turns (sampled at T=1 from the chat
   template up to the user header), kept when complete, 4-60 words, not a
   word problem, and not near a held-out, calibration or validation prompt
   (``drafter_prompts.near_duplicates``, 0.5);
2. it answers them at T=0 (192 tokens at most) and continues the code and
   prose beginnings at T=0 (96 tokens);
3. continuations of the shipped drafter, one per ``--lr``, train on those,
   the committed answer and continuation shards and the plain-text slices,
   with the target as an online teacher in float32 (the drafter's own
   products in TF32), warm-up then cosine decay over the time left;
4. ``$OUT`` gets each drafter's float16 weights (``d{i}_w1.npz``,
   ``d{i}_rest.npz``, every few minutes and at the end), the user turns, the
   generated sequences and ``log.json`` (throughput, validation metrics).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import torch_drafter as td  # noqa: E402
from codec import read_parts  # noqa: E402
from drafter_prompts import near_duplicates  # noqa: E402
from torch_target import Target, generate  # noqa: E402

STASH = Path("/tmp/gpu-stash")
REQUESTS = ROOT / "examples" / "data" / "target-requests"
WORD_PROBLEM = re.compile(
    r"\d.*\b(how (many|much)|what is the (total|average|cost))\b"
    r"|\b(how (many|much)|total|average)\b.*\d",
    re.I,
)
ANCHORS, GAMMA, WARMUP = 64, 4.0, 0.04
VALIDATION = {"magpie": 192, "continued": 64, "text": 64}
SAVED_SEQUENCES = 24_000  # a returned file holds at most 16 MiB


class Run:
    """The clock, the log and the output folder of one run."""

    def __init__(self, out: Path):
        self.start = time.time()
        self.out = out
        self.events: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.time() - self.start

    def log(self, **event) -> None:
        event["t"] = round(self.elapsed(), 1)
        self.events.append(event)
        print(json.dumps(event), flush=True)
        (self.out / "log.json").write_text(json.dumps(self.events))


def user_turns(
    target, tokenizer, meta, stop_ids, run, seconds, batch, generator
) -> list[str]:
    questions, sampled = [], 0
    stop = time.time() + seconds
    while not sampled or time.time() < stop:
        tic = time.time()
        turns = generate(
            target,
            [meta["user_prefix"]] * batch,
            64,
            1.0,
            stop_ids,
            batch,
            generator,
        )
        sampled += len(turns)
        for turn in turns:
            if not turn or turn[-1] not in stop_ids:
                continue
            text = tokenizer.decode(turn[:-1]).strip()
            if (
                4 <= len(text.split()) <= 60
                and not WORD_PROBLEM.search(text)
                and not text.endswith(":")
            ):
                questions.append(text)
        run.log(
            event="user_turns",
            sampled=sampled,
            kept=len(questions),
            s=round(time.time() - tic, 2),
        )
    questions = list(dict.fromkeys(questions))
    near = {p for p, _, _ in near_duplicates(questions, meta["held_out"], 0.5)}
    run.log(event="user_turns_done", unique=len(questions), near_held_out=len(near))
    return [q for q in questions if q not in near]


def answered(target, prompts, max_tokens, stop_ids, seconds, batch, run, kind):
    """``(tokens, loss_mask, kind)`` of each prompt answered before the time is up."""
    sequences = []
    stop = time.time() + seconds
    for first in range(0, len(prompts), batch):
        if time.time() >= stop:
            break
        tic = time.time()
        chunk = prompts[first : first + batch]
        for prompt, answer in zip(
            chunk,
            generate(target, chunk, max_tokens, 0.0, stop_ids, batch),
            strict=True,
        ):
            mask = np.zeros(len(prompt) + len(answer), bool)
            mask[len(prompt) :] = True
            sequences.append((np.array(prompt + answer, np.int32), mask, kind))
        run.log(event=kind, done=len(sequences), s=round(time.time() - tic, 2))
    return sequences


def committed(seq_len: int, exclude: set[tuple[int, ...]]) -> list:
    """The committed answer, continuation and target-written request shards."""
    data = ROOT / "examples" / "data"
    sequences = []
    for path in sorted(
        glob.glob(f"{data}/regenerated/t*.jsonl.gz")
        + glob.glob(f"{data}/continued/t*.jsonl.gz")
        + glob.glob(f"{REQUESTS}/*.jsonl.gz")
    ):
        for line in gzip.open(path, "rt"):
            row = json.loads(line)
            start = row["loss_start"]
            if len(row["tokens"]) > seq_len or tuple(row["tokens"][:start]) in exclude:
                continue
            mask = np.zeros(len(row["tokens"]), bool)
            mask[start:] = True
            sequences.append((np.array(row["tokens"], np.int32), mask, "committed"))
    return sequences


def write_shard(path: Path, sequences: list) -> None:
    """Answer shards as the recipe writes them (``tokens``, ``loss_start``)."""
    staging = path.with_name(path.name + ".tmp")
    with gzip.open(staging, "wt") as f:
        for tokens, mask, _ in sequences:
            row = {"tokens": tokens.tolist(), "loss_start": int(np.argmax(mask))}
            f.write(json.dumps(row) + "\n")
    os.replace(staging, path)


def save_generated(out: Path, sequences: list) -> None:
    kept = sequences[:SAVED_SEQUENCES]
    np.savez_compressed(
        out / "generated.npz",
        tokens=np.concatenate([t for t, _, _ in kept]).astype(np.uint16),
        lengths=np.array([len(t) for t, _, _ in kept]),
        loss_start=np.array([int(np.argmax(m)) for _, m, _ in kept]),
        magpie=np.array([k == "magpie" for _, _, k in kept]),
    )


def save_drafters(out: Path, drafters: list) -> None:
    for i, drafter in enumerate(drafters):
        weights = {k: v.astype(np.float16) for k, v in drafter.numpy_weights().items()}
        embedding = "markov_head.markov_w1.weight"
        parts = {"w1": {embedding: weights.pop(embedding)}, "rest": weights}
        for name, part in parts.items():
            staging = out / f"d{i}_{name}.tmp.npz"
            np.savez(staging, **part)
            os.replace(staging, out / f"d{i}_{name}.npz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stash", type=Path, help="copy this part to the machine and stop"
    )
    parser.add_argument("--parts", help="comma-separated target parts")
    parser.add_argument("--data", type=Path, default=Path(".gpu/data"))
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ".gpu/out"))
    )
    parser.add_argument(
        "--budget", type=float, default=520, help="seconds before the last save"
    )
    parser.add_argument("--user-seconds", type=float, default=45)
    parser.add_argument("--answer-seconds", type=float, default=110)
    parser.add_argument("--continue-seconds", type=float, default=25)
    parser.add_argument("--lr", default="6e-4,1.5e-3", help="one drafter per rate")
    parser.add_argument("--sequences", type=int, default=64, help="sequences a step")
    parser.add_argument("--gen-batch", type=int, default=768)
    parser.add_argument(
        "--write-shard",
        type=int,
        metavar="N",
        help="write the answered user turns as request shard N and stop",
    )
    args = parser.parse_args()
    if args.stash:
        shutil.copytree(args.stash, STASH / args.stash.name, dirs_exist_ok=True)
        print(
            f"stashed {args.stash} in {STASH}; torch {torch.__version__}, "
            f"cuda {torch.cuda.is_available()}",
            flush=True,
        )
        return
    if not args.parts:
        parser.error("--parts is required: pack.py's part-a,part-b (or --stash)")
    parts = args.parts.split(",")
    missing = [str(p) for p in (*parts, args.data) if not Path(p).is_dir()]
    gone = [p for p in missing if Path(p).is_relative_to(STASH)]
    if gone:
        parser.error(
            f"{', '.join(gone)} is gone: the machine the first call stashed it "
            "on went back (a machine stays only about 30 s after a call), so run "
            "the --stash call again and this one right after it"
        )
    if missing:
        parser.error(f"not a folder of pack.py's output: {', '.join(missing)}")
    run = Run(args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = json.loads((args.data / "meta.json").read_text())
    seq_len = meta["seq_len"]
    weights = read_parts(parts)
    config = json.loads((Path(parts[0]) / "config.json").read_text())
    drafter_dir = ROOT / "mlx_dspark" / "assets" / "default_drafter"
    draft_config, start = td.read_drafter(drafter_dir)
    target = Target(weights, config, tuple(draft_config["target_layer_ids"]), device)
    del weights
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(parts[0]) / "tokenizer.json"))
    seed = 0 if args.write_shard is None else 1000 + args.write_shard
    generator = torch.Generator(device=device).manual_seed(seed)
    run.log(
        event="loaded",
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
    )

    stop_ids = set(meta["stop"])
    questions = user_turns(
        target,
        tokenizer,
        meta,
        stop_ids,
        run,
        args.user_seconds,
        args.gen_batch,
        generator,
    )
    np.random.default_rng(0).shuffle(questions)
    with gzip.open(args.out / "questions.json.gz", "wt") as f:
        json.dump(questions, f)
    prompts = [
        tokenizer.encode(
            meta["before"] + q + meta["after"], add_special_tokens=False
        ).ids
        for q in questions
    ]
    prompts = [p for p in prompts if len(p) <= seq_len - meta["answer_tokens"]]
    generated = answered(
        target,
        prompts,
        meta["answer_tokens"],
        stop_ids,
        args.answer_seconds,
        args.gen_batch,
        run,
        "magpie",
    )
    if args.write_shard is not None:
        REQUESTS.mkdir(parents=True, exist_ok=True)
        write_shard(REQUESTS / f"r{args.write_shard:04d}.jsonl.gz", generated)
        return
    stored = np.load(args.data / "beginnings.npz")
    offsets, flat = stored["offsets"], stored["tokens"].astype(np.int64)
    beginnings = [
        flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]
    generated += answered(
        target,
        beginnings,
        meta["continuation_tokens"],
        stop_ids,
        args.continue_seconds,
        args.gen_batch,
        run,
        "continued",
    )
    save_generated(args.out, generated)

    text = np.load(args.data / "text.npz")
    plain = [
        (row.astype(np.int32), np.ones(seq_len, bool), "text")
        for name in ("code", "docs")
        for row in text[name]
    ]
    pool = {"magpie": [], "continued": [], "text": plain}
    for sequence in generated:
        if len(sequence[0]) <= seq_len and sequence[1][1:].any():
            pool[sequence[2]].append(sequence)
    exclude = {tuple(p) for p in meta["exclude_prompts"]}
    shards = committed(seq_len, exclude)
    seen = {tuple(t[: np.argmax(m)]) for t, m, _ in shards}
    pool["magpie"].sort(key=lambda s: tuple(s[0][: np.argmax(s[1])]) in seen)
    validation = [s for kind, n in VALIDATION.items() for s in pool[kind][:n]]
    training = [s for kind, n in VALIDATION.items() for s in pool[kind][n:]]
    training += shards
    run.log(
        event="pool",
        training=len(training),
        validation=len(validation),
        **{kind: len(rows) for kind, rows in pool.items()},
    )

    embed = target.embed
    rates = [float(r) for r in args.lr.split(",")]
    drafters = [td.Drafter(draft_config, start, embed).to(device) for _ in rates]
    optimizers = [
        torch.optim.AdamW(d.parameters(), lr=lr, weight_decay=0.0)
        for d, lr in zip(drafters, rates, strict=True)
    ]
    draft_ids = drafters[0].draft_ids
    to_draft = np.full(embed.shape[0], -1, np.int64)
    to_draft[draft_ids.cpu().numpy()] = np.arange(len(draft_ids))
    block, mask_id = draft_config["block_size"], draft_config["mask_token_id"]

    def batch_of(sequences, rng):
        pairs = [(t, m) for t, m, _ in sequences]
        batch = td.make_batch(
            pairs, ANCHORS, block, mask_id, GAMMA, rng, to_draft, seq_len
        )
        return td.to_device(batch, device)

    checks = []
    rng = np.random.default_rng(1)
    for kind in VALIDATION:
        rows = [s for s in validation if s[2] == kind]
        checks += [
            (kind, batch_of(rows[i : i + args.sequences], rng))
            for i in range(0, len(rows), args.sequences)
        ]

    def validate(step: int) -> None:
        terms = {}
        with torch.no_grad():
            for kind, batch in checks:
                taught = td.teacher(
                    target, batch["tokens"], draft_ids, batch["positions"]
                )
                for i, drafter in enumerate(drafters):
                    _, values = td.loss_terms(drafter, *taught, batch)
                    terms.setdefault(f"d{i}_{kind}", []).append(
                        torch.stack(values).tolist()
                    )
        run.log(
            event="validation",
            step=step,
            metrics="ce tv conf tau greedy_tau",
            **{k: np.round(np.mean(v, 0), 4).tolist() for k, v in terms.items()},
        )

    validate(0)
    began, seconds = time.time(), args.budget - run.elapsed()
    rng = np.random.default_rng(2)
    order, cursor, step, recent = rng.permutation(len(training)), 0, 0, []
    last_check = last_save = time.time()
    while seconds > 0 and (done := (time.time() - began) / seconds) < 1:
        if cursor + args.sequences > len(order):
            order, cursor = rng.permutation(len(training)), 0
        batch = batch_of(
            [training[i] for i in order[cursor : cursor + args.sequences]], rng
        )
        cursor += args.sequences
        taught = td.teacher(target, batch["tokens"], draft_ids, batch["positions"])
        if done < WARMUP:
            scale = done / WARMUP
        else:
            scale = 0.1 + 0.45 * (
                1 + math.cos(math.pi * (done - WARMUP) / (1 - WARMUP))
            )
        values = []
        torch.backends.cuda.matmul.allow_tf32 = True
        for drafter, optimizer, lr in zip(drafters, optimizers, rates, strict=True):
            for group in optimizer.param_groups:
                group["lr"] = lr * scale
            loss, terms = td.loss_terms(drafter, *taught, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            values.append(torch.stack([loss.detach(), *terms]).tolist())
        torch.backends.cuda.matmul.allow_tf32 = False
        step += 1
        recent.append(values)
        if step % 50 == 0:
            run.log(
                event="train",
                step=step,
                epochs=round(step * args.sequences / len(training), 2),
                lr_scale=round(scale, 3),
                loss_terms_tau_greedy=np.round(np.mean(recent, 0), 4).tolist(),
            )
            recent = []
        if time.time() - last_check > 100 and seconds - (time.time() - began) > 100:
            validate(step)
            last_check = time.time()
        if time.time() - last_save > 150:
            save_drafters(args.out, drafters)
            last_save = time.time()
    if step:
        validate(step)
    save_drafters(args.out, drafters)
    run.log(event="done", steps=step, sequences=step * args.sequences, rates=rates)


if __name__ == "__main__":
    main()
