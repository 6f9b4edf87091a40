"""The optimisation loop: steps, progress, clean stops, periodic checkpoints."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.nn.utils import average_gradients

from .batches import Batch
from .loss import loss_terms

METRICS = ("loss", "ce", "tv", "conf", "tau", "greedy_tau")
Teacher = Callable[[list[int], Batch], tuple[mx.array, mx.array, mx.array]]
# (drafter, features, target_p, outside, batch) -> (loss, terms)
Loss = Callable[..., tuple[mx.array, tuple[mx.array, ...]]]


@dataclass
class LoopState:
    """What the loop carries across steps, checkpoints and resumed runs."""

    step: int = 0
    history: list = field(default_factory=list)
    block_positions: int = 0  # supervised block positions trained on
    train_time_s: float = 0.0  # spent in steps (data, teacher, forward, update)
    validation: list = field(default_factory=list)  # [step, train_time_s, *METRICS]

    @property
    def positions_per_s(self) -> float:
        return self.block_positions / self.train_time_s if self.train_time_s else 0.0


def schedule(lr: float, total: int, warmup: int):
    """Linear warm-up, then cosine decay to a tenth."""
    decay = optim.cosine_decay(lr, max(total - warmup, 1), end=0.1 * lr)
    if warmup <= 0:
        return decay
    return optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup), decay], [warmup]
    )


def make_step(
    drafter: nn.Module,
    optimizer: optim.Optimizer,
    grad_clip: float,
    compiled: bool = True,
    group: mx.distributed.Group | None = None,
    greedy_weight: float = 0.0,
    loss: Loss | None = None,
    batch_type: type = Batch,
) -> Callable[[mx.array, mx.array, mx.array, Batch], list[float]]:
    """One update from a batch and its teacher; returns the metrics.

    ``compiled`` traces the whole update (forward, backward, clip, AdamW) into
    one graph per batch shape with ``mx.compile``, the drafter's and the
    optimizer's state as its inputs and outputs, as mlx-lm's trainer does; it
    computes the same update as the eager one. With a ``group`` of processes
    each trains on its share of the step (:func:`~.batches.shard`); their
    gradients and metrics are averaged, so every rank makes the same update.
    ``loss`` (default: the DSpark loss) returns the loss and the terms after
    ``loss`` in :data:`METRICS`, from batches of ``batch_type``.
    """
    loss = loss or partial(loss_terms, greedy_weight=greedy_weight)
    loss_and_grad = nn.value_and_grad(drafter, loss)

    def update(features, target_p, outside, denominators, *arrays):
        batch = batch_type(*arrays, supervised=0, denominators=denominators)
        (loss, terms), grads = loss_and_grad(
            drafter, features, target_p, outside, batch
        )
        if group is not None:
            grads = average_gradients(grads, group)
            size = group.size()
            metrics = mx.distributed.all_sum(mx.stack([loss, *terms]), group=group)
            loss, *terms = metrics / size
        if grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, grad_clip)
        optimizer.update(drafter, grads)
        return loss, *terms

    if compiled:
        optimizer.init(drafter.trainable_parameters())
        state = [drafter.state, optimizer.state]
        update = mx.compile(update, inputs=state, outputs=state)

    def step(
        features: mx.array, target_p: mx.array, outside: mx.array, batch: Batch
    ) -> list[float]:
        metrics = update(
            features, target_p, outside, batch.denominators, *batch.arrays()
        )
        mx.eval(drafter.parameters(), optimizer.state, metrics)
        return [m.item() for m in metrics]

    return step


def make_validation(
    drafter: nn.Module,
    teacher: Teacher,
    batches: list[tuple[list[int], Batch]],
    greedy_weight: float = 0.0,
    loss: Loss | None = None,
) -> Callable[[], list[float]]:
    """The mean metrics over held-out batches (anchors fixed once), without
    updating anything."""
    loss = loss or partial(loss_terms, greedy_weight=greedy_weight)

    def validate() -> list[float]:
        rows = []
        for indices, batch in batches:
            value, terms = loss(drafter, *teacher(indices, batch), batch)
            mx.eval(value, terms)
            rows.append([value.item(), *(t.item() for t in terms)])
        return np.mean(rows, axis=0).tolist()

    return validate


def optimise(
    step: Callable[[mx.array, mx.array, mx.array, Batch], list[float]],
    next_batch: Callable[[int], tuple[list[int], Batch]],
    teacher: Teacher,
    state: LoopState,
    total: int,
    *,
    log_every: int,
    checkpoint_every: int,
    save: Callable[[LoopState], None],
    should_stop: Callable[[int], bool] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    validate: Callable[[], list[float]] | None = None,
    validate_every: int = 50,
    agree: Callable[[bool], bool] | None = None,
) -> tuple[str, dict]:
    """Run steps ``state.step .. total``; returns the status ("done" or
    "interrupted") and the mean metrics over the last tenth of the steps.
    ``progress(step, total, metrics)`` follows every step; ``validate()``
    runs every ``validate_every`` steps and at the end, outside the timed
    steps, into ``state.validation``. ``agree(stop)`` tells data-parallel
    processes whether any of them stops, so that all stop at one step."""
    running = None
    recent: list[list[float]] = []
    status = "done"
    with StopFlag() as stop:
        while state.step < total:
            tic = time.perf_counter()
            indices, batch = next_batch(state.step)
            values = step(*teacher(indices, batch), batch)
            state.train_time_s += time.perf_counter() - tic
            state.block_positions += batch.supervised
            state.step += 1
            recent = (recent + [values])[-max(1, total // 10) :]
            running = (
                values
                if running is None
                else [0.9 * r + 0.1 * v for r, v in zip(running, values, strict=True)]
            )
            if state.step % log_every == 0 or state.step == total:
                state.history.append([state.step, *values])
            if validate is not None and (
                state.step % validate_every == 0 or state.step == total
            ):
                state.validation.append(
                    [state.step, round(state.train_time_s, 3), *validate()]
                )
            shown = "  ".join(
                f"{n} {v:.3f}" for n, v in zip(METRICS, running, strict=True)
            )
            shown += f"  {state.positions_per_s:.0f} pos/s"
            if state.validation:
                last = dict(zip(METRICS, state.validation[-1][2:], strict=False))
                shown += f"  val tau {last['tau']:.3f}"
                if "greedy_tau" in last:
                    shown += f" greedy {last['greedy_tau']:.3f}"
            if progress is not None:
                progress(state.step, total, shown)
            if checkpoint_every and state.step % checkpoint_every == 0:
                if state.step < total:
                    save(state)
            stopping = stop.requested or (
                should_stop is not None and should_stop(state.step)
            )
            if agree is not None:
                stopping = agree(stopping)
            if stopping:
                if state.step < total:
                    status = "interrupted"
                    break
    final = {
        n: float(np.mean([r[i] for r in recent])) if recent else None
        for i, n in enumerate(METRICS)
    }
    return status, final


class StopFlag:
    """Ctrl-C asks for a clean stop at the end of the step; twice aborts."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
