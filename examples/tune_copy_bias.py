"""Choose a drafter's context-copy bias (``context_copy_bias``) on validation text.

    python examples/tune_copy_bias.py --work ~/dspark-default

Teacher-forced on the recipe's validation answers (the target's T=0 answers to
questions no template writes) and on its last regenerated T=0 shard: at every
anchor, the drafter's rows for 7 drafts plus the bias on the tokens copied
from the context (``mlx_dspark.proposers.suffix_store.context_copy``) while the drafts follow
them, exactly as a greedy chain drafts them. Prints the mean accepted length
(accepted drafts + 1) per bias and set, copying after matches of at least 1,
2 or 3 tokens (the shipped ``COPY_CONFIG.min_match`` is 2); the held-out sets of
``eval_default_pair.py`` are never read.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
from pathlib import Path

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import mlx.core as mx
import numpy as np

from mlx_dspark.errors import DSparkError
from mlx_dspark.proposers.copying import COPY_CONFIG
from mlx_dspark.proposers.suffix_store import context_copy
from mlx_dspark.targets.adapter import TargetAdapter
from mlx_dspark.training.loss import draft_logits
from mlx_dspark.training.model import training_hidden

BIASES = (0.0, 2.0, 4.0, 6.0, 10.0, 20.0, 100.0)
MIN_NGRAMS = (1, 2, 3)
REGEN_DIR = Path(__file__).resolve().parent / "data" / "regenerated"


def answers(work: Path, max_len: int) -> list[tuple[str, list[int], int]]:
    """(set, tokens, first answer position) of each validation answer and of
    the last regenerated T=0 shard's answers; answers that ``max_len`` cuts
    before their second token are left out (they hold no anchor)."""
    files = [*sorted((work / "validation" / "chat").glob("*.jsonl.gz"))]
    files.append(sorted(REGEN_DIR.glob("t000-*.jsonl.gz"))[-1])
    out = []
    for path in files:
        with gzip.open(path, "rt") as f:
            for line in f:
                record = json.loads(line)
                name = "validation" if "validation" in path.parts else record["tag"]
                tokens, start = record["tokens"][:max_len], record["loss_start"]
                if max(start, 1) < len(tokens) - 1:
                    out.append((name, tokens, start))
    return out


def accepted_lengths(drafter, target, tokens, start, biases, min_ngram) -> np.ndarray:
    """Teacher-forced accepted length per anchor for each bias, copying after
    matches of at least ``min_ngram`` tokens: ``[biases, anchors]``."""
    config = dataclasses.replace(COPY_CONFIG, min_match=min_ngram)
    block = drafter.block_size
    _, features = target.hidden(mx.array(tokens)[None], target.make_cache())
    anchors = np.arange(max(start, 1), len(tokens) - 1)
    blocks = np.full((len(anchors), block), drafter.config.mask_token_id, np.int32)
    blocks[:, 0] = np.array(tokens)[anchors]
    padded = np.array([*tokens, *[-2] * block])
    labels = padded[anchors[:, None] + np.arange(block) + 1]
    prev = np.concatenate([blocks[:, :1], np.maximum(labels[:, :-1], 0)], axis=1)
    hidden = training_hidden(
        drafter,
        features.astype(mx.float32),
        mx.array(anchors)[None],
        mx.array(blocks)[None],
    )
    rows = np.array(draft_logits(drafter, hidden, mx.array(prev)), dtype=np.float64)
    copies = np.stack([context_copy(tokens[: a + 1], block, config) for a in anchors])
    # A draft position carries the bias while the drafts before it (here the
    # labels, as only an accepted prefix counts) equal the copied tokens.
    following = np.cumprod(
        np.concatenate(
            [np.ones((len(anchors), 1), bool), copies[:, :-1] == labels[:, :-1]], 1
        ),
        axis=1,
    ).astype(bool)
    ids = (
        np.array(drafter.draft_to_target)
        if drafter.config.reduced_vocab
        else np.arange(rows.shape[-1])
    )
    hit = following[..., None] & (ids[None, None, :] == copies[..., None])
    # A copied token the draft vocabulary lacks is drafted as it is.
    outside = following & (copies >= 0) & ~hit.any(-1)
    out = []
    for bias in biases:
        drafts = ids[(rows + bias * hit).argmax(-1)]
        if bias:
            drafts = np.where(outside, copies, drafts)
        out.append(1 + np.cumprod(drafts == labels, axis=1).sum(1))
    return np.array(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("~/dspark-default"))
    parser.add_argument(
        "--draft-model", default=None, help="default: the shipped drafter"
    )
    parser.add_argument("--max-len", type=int, default=400)
    args = parser.parse_args()
    work = args.work.expanduser()
    if not any((work / "validation" / "chat").glob("*.jsonl.gz")):
        parser.error(
            f"no validation answers under {work / 'validation' / 'chat'}: "
            "python examples/train_default_drafter.py --work WORK --data-only "
            "writes them"
        )
    texts = answers(work, args.max_len)
    if not texts:
        parser.error(f"--max-len {args.max_len} leaves no answer token to draft")
    model, _, drafter = mlx_dspark.load()
    if args.draft_model:
        try:
            drafter = mlx_dspark.load_drafter(args.draft_model, model)
        except DSparkError as error:
            parser.error(str(error))
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    best = (0.0, 0.0, 0)  # (mean to 3 decimals, -bias: the smaller bias of a tie, n)
    for min_ngram in MIN_NGRAMS:
        lengths: dict[str, list[np.ndarray]] = {}
        for name, tokens, start in texts:
            lengths.setdefault(name, []).append(
                accepted_lengths(drafter, target, tokens, start, BIASES, min_ngram)
            )
        sets = {name: np.concatenate(v, 1) for name, v in lengths.items()}
        every = np.concatenate(list(sets.values()), 1)
        print(f"matches of >= {min_ngram} tokens")
        print("bias   " + " ".join(f"{name:>10s}" for name in sets) + "        all")
        for i, bias in enumerate(BIASES):
            cells = " ".join(f"{v[i].mean():10.3f}" for v in sets.values())
            print(f"{bias:5.1f}  {cells} {every[i].mean():10.3f}")
            best = max(best, (round(every[i].mean(), 3), -bias, min_ngram))
    print(f"best: bias {-best[1]:g}, matches of >= {best[2]} tokens")


if __name__ == "__main__":
    main()
