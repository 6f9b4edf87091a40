"""Round cost profiles of built-in pairs, side by side (one process).

    python examples/cost_profile_pairs.py --pairs smollm2-135m gemma3-270m

For each pair: the target forward's time at k = 1 .. ``--k-max`` query tokens
(verifying k - 1 drafts) at contexts 64 and 256, and one drafting round, as
the default policy measures them (:func:`mlx_dspark.policy.profile.measure_profile`).
The pairs are measured in turn ``--rounds`` times, interleaved, and the
median of each figure is printed: milliseconds, and the cost relative to a
one-token step. Run it on an otherwise idle machine; it prints the BLAS used.
"""

from __future__ import annotations

import argparse

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import numpy as np

from mlx_dspark.blas import mapped_libraries
from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.profile import measure_profile
from mlx_dspark.targets.adapter import TargetAdapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--k-max", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.k_max < 1 or args.rounds < 1 or args.repeats < 1:
        parser.error("--k-max, --rounds and --repeats must be at least 1.")
    loaded = {}
    for name in args.pairs:
        try:
            model, _, drafter = mlx_dspark.load(pair=name)
        except DSparkError as error:
            parser.error(str(error))
        loaded[name] = (TargetAdapter(model, drafter.config.target_layer_ids), drafter)
    blas = [lib for lib in mapped_libraries() if "blas" in lib.lower()]
    print(f"BLAS libraries mapped: {', '.join(blas) or 'none found'}")
    step = {name: [] for name in loaded}
    draft = {name: [] for name in loaded}
    for _ in range(args.rounds):
        for name, (target, drafter) in loaded.items():
            curve = measure_profile(
                target, drafter, n_max=args.k_max - 1, repeats=args.repeats
            )
            step[name].append([1 / s for s in curve.steps_per_second])
            draft[name].append(curve.draft_seconds)
    ks = range(1, args.k_max + 1)
    print("k (query tokens)  " + "  ".join(f"{name:>22}" for name in loaded))
    medians = {name: np.median(np.array(step[name]), axis=0) for name in loaded}
    for i, k in enumerate(ks):
        cells = [
            f"{1e3 * m[i]:9.1f} ms ({m[i] / m[0]:5.2f}x)" for m in medians.values()
        ]
        print(f"{k:17d}  " + "  ".join(f"{c:>22}" for c in cells))
    cells = [f"{1e3 * np.median(draft[name]):9.1f} ms" for name in loaded]
    print(f"{'drafting round':>17}  " + "  ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
