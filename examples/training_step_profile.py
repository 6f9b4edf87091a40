"""Where a training step's time goes on the default pair (one process).

    python examples/training_step_profile.py [ANCHORS] [SEQUENCES]

Loads the built-in default pair's target, builds the default recipe's drafter
(1 layer from the target's top layer, 4096-token draft vocabulary) over the
committed regenerated answers, and times, for three batches: the target's body
(tapped features), its LM head and softmax over the draft vocabulary, and the
drafter's compiled update. Prints supervised block positions per second end to
end and for the update alone: the first is what ``mlx_dspark.train`` reaches
with the target run on the fly, the second with a teacher store.
"""

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx_lm import load

from mlx_dspark.pairs.default import target_dir
from mlx_dspark.targets.adapter import TargetAdapter
from mlx_dspark.training.batches import draft_vocabulary, make_batch
from mlx_dspark.training.data import load_sequences
from mlx_dspark.training.model import drafter_config, new_drafter
from mlx_dspark.training.teacher import _gather, target_distribution
from mlx_dspark.training.trainer import make_step

ANSWERS = Path(__file__).resolve().parent / "data" / "regenerated"


def seconds() -> float:
    mx.synchronize()
    return time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("anchors", type=int, nargs="?", default=160)
    parser.add_argument("sequences", type=int, nargs="?", default=4)
    args = parser.parse_args()
    anchors, count = args.anchors, args.sequences
    path = target_dir()
    model, tokenizer = load(str(path))
    config = json.loads((path / "config.json").read_text())
    target = TargetAdapter(model, [1, 8, 14, 20, 27])
    sequences, _ = load_sequences(
        sorted(ANSWERS.glob("t000-000[01].jsonl.gz")), tokenizer, 320
    )
    vocab = draft_vocabulary(sequences, 4096, target.vocab_size)
    drafter = new_drafter(
        drafter_config(
            config, target, layers=1, block_size=7, markov_head="vanilla",
            markov_rank=64, anchors=anchors, confidence=True,
            mask_token_id=target.vocab_size - 1, draft_vocab_size=4096,
        ),
        target, 0, vocab.ids, init_from_target=True,
    )  # fmt: skip
    step = make_step(drafter, optim.AdamW(learning_rate=1e-4), 1.0)
    rng = np.random.default_rng(0)
    for i in range(3):
        chosen = sequences[i * count : (i + 1) * count]
        batch = make_batch(
            chosen, anchors, 7, target.vocab_size - 1, 4.0, rng,
            vocab.target_to_draft, length=320,
        )  # fmt: skip
        t0 = seconds()
        hidden, features = target.hidden(batch.tokens, target.make_cache())
        mx.eval(hidden, features)
        t1 = seconds()
        probs, outside = target_distribution(target, hidden, vocab.ids)
        t2 = seconds()
        step(
            features.astype(mx.float32),
            _gather(mx.array(probs), batch.positions),
            _gather(mx.array(outside), batch.positions),
            batch,
        )
        t3 = seconds()
        n = batch.supervised
        print(
            f"batch {i + 1} ({count} x 320 tokens, {n} positions): target body "
            f"{t1 - t0:.1f} s, head + softmax {t2 - t1:.1f} s, update {t3 - t2:.1f} s"
            f" -> {n / (t3 - t0):.0f} positions/s ({n / (t3 - t2):.0f} for the update)"
        )


if __name__ == "__main__":
    main()
