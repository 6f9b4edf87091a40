"""Step 3 of the GPU route (here, with MLX): a drafter trained on the device
as a 4-bit drafter directory.

    python examples/gpu/install.py gpu-out 0 drafters/gpu-0

takes ``d0_w1.npz`` and ``d0_rest.npz`` from the run's output, puts them in
a drafter of the shipped drafter's shape (LM head: the target's rows of the
draft ids, as training has it) and writes it with ``export_drafter``, 4-bit
like the recipe, with the shipped drafter's context-copy bias and training
record plus the run's last log entry. Calibrate it afterwards:
``python -m mlx_dspark.calibrate --drafter DEST ...`` (see the README).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_dspark.checkpoints.loading import load_target
from mlx_dspark.pairs.default import default_pair
from mlx_dspark.targets.adapter import TargetAdapter
from mlx_dspark.training.checkpoint import export_drafter
from mlx_dspark.training.model import (
    copy_trained_weights,
    new_drafter,
    trained_drafter,
)


def install(run: Path, index: int, dest: Path) -> None:
    target_path, shipped_path = default_pair()
    _, _, model, _ = load_target(target_path)
    shipped = trained_drafter(shipped_path, model)
    target = TargetAdapter(model, shipped.config.target_layer_ids)
    drafter = new_drafter(shipped.config, target, 0, np.array(shipped.draft_to_target))
    copy_trained_weights(drafter, shipped, target)
    weights = {}
    for part in ("w1", "rest"):
        path = run / f"d{index}_{part}.npz"
        if not path.exists():
            raise SystemExit(f"{path} is missing: not a GPU run's output.")
        with np.load(path) as stored:
            weights |= {k: stored[k] for k in stored.files}
    expected = {k for k, _ in tree_flatten(drafter.trainable_parameters())}
    if set(weights) != expected:
        raise SystemExit(f"{run} holds other weights than the shipped drafter trains.")
    drafter.load_weights(
        [(k, mx.array(v.astype(np.float32))) for k, v in weights.items()], strict=False
    )
    drafter.config.context_copy_bias = shipped.config.context_copy_bias
    record = json.loads((shipped_path / "training_record.json").read_text())
    record["gpu_run"] = json.loads((run / "log.json").read_text())[-1]
    export_drafter(dest, drafter, target, record, False, mx.float32, (4, 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the GPU run's output folder")
    parser.add_argument("index", type=int, help="which of its drafters (d0, d1, ...)")
    parser.add_argument("dest", type=Path)
    args = parser.parse_args()
    install(args.run, args.index, args.dest)
    print(f"wrote {args.dest}", flush=True)


if __name__ == "__main__":
    main()
