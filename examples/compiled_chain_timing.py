"""Time greedy drafting through the default drafter's sequential head, with
and without ``mx.compile`` (calls interleaved, medians), and check that both
give the same drafts::

    python examples/compiled_chain_timing.py
"""

from __future__ import annotations

import statistics
import time

# isort: off
from mlx_dspark.pairs.default import drafter_dir, target_dir  # first: a fast BLAS
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.sampling.processing import SamplingParams

import mlx.core as mx
from mlx_lm import load

# isort: on


def main(calls: int = 400) -> None:
    model, _ = load(str(target_dir()))
    drafter = load_drafter(drafter_dir(), model)
    compiled_chain = drafter._compiled_chain
    hidden = mx.random.normal((1, drafter.block_size, drafter.config.hidden_size))
    anchor = mx.array([42])
    for n in (1, 3, drafter.block_size):
        times: dict[bool, list[float]] = {False: [], True: []}
        drafts: dict[bool, mx.array] = {}
        for call in range(calls):
            compiled = call % 2 == 1
            drafter._compiled_chain = compiled_chain if compiled else None
            start = time.perf_counter()
            proposal = drafter.propose(
                hidden, anchor, n, SamplingParams(), None, confidence=False
            )
            mx.eval(proposal.tokens)
            times[compiled].append(time.perf_counter() - start)
            drafts[compiled] = proposal.tokens
        plain, fast = (statistics.median(times[c][5:]) * 1e3 for c in (False, True))
        same = mx.array_equal(drafts[False], drafts[True]).item()
        print(
            f"{n} drafts: plain {plain:.3f} ms, compiled {fast:.3f} ms, "
            f"ratio {fast / plain:.3f}, same drafts: {same}"
        )


if __name__ == "__main__":
    main()
