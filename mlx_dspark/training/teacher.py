"""What the frozen target teaches: its features and next-token distributions.

Training needs, for each sequence, the target's hidden states at the tapped
layers (the drafter's context) and, at each supervised position, the target's
next-token distribution. :class:`TeacherStore` computes both once and keeps
them on disk, memory-mapped:

* ``features.npy`` ``[T, F]`` float16 (bfloat16 bits as uint16 when a value
  would overflow float16) - the tapped features of all T tokens;
* ``probs.npy`` ``[T, V]`` float16 - the target's distribution restricted to
  the V ids of the drafter's output vocabulary;
* ``outside.npy`` ``[T]`` float32 - the target's mass outside those ids.

So training never runs the target, its 49k-wide LM head or its softmax. The
loss is unchanged: it only ever reads the target's probabilities of the draft
ids and the mass outside them (:mod:`.loss`). What the store changes is
rounding: each probability is rounded to float16 (relative error at most
2**-11, absolute at most 2**-25 below float16's normal range), so the total
variation term moves by at most ``2**-11 + V * 2**-25`` per position, and the
features are rounded to float16 as well. ``dtype="float32"`` keeps both
exact (twice the disk). :class:`OnlineTeacher` computes the same on the fly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..targets.adapter import TargetAdapter
from ..utils import write_text_atomic
from .batches import Batch
from .data import Sequence

STORE_VERSION = 1
F16_MAX = 6.0e4
ARRAYS = ("features", "probs", "outside")


def target_distribution(
    target: TargetAdapter, hidden: mx.array, draft_ids: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The target's probabilities ``[..., V]`` over ``draft_ids`` (all ids when
    None) from final hidden states, and its mass outside them ``[...]``.

    The softmax runs in NumPy: one exp pass over the vocabulary, vectorised
    (MLX's CPU exp is about 8x slower here), and pairwise sums, which keep
    these within about 1e-7 of the exact values where MLX's float32
    ``logsumexp`` is off by up to 1e-4."""
    logits = np.array(target.lm_head(hidden).astype(mx.float32))
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits, out=logits)
    total = weights.sum(axis=-1)
    if draft_ids is None:
        weights /= total[..., None]
        return weights, np.zeros(total.shape, np.float32)
    rest = np.ones(weights.shape[-1], np.float32)
    rest[draft_ids] = 0.0
    return weights[..., draft_ids] / total[..., None], (weights @ rest) / total


def _gather(rows: mx.array, positions: mx.array) -> mx.array:
    """``rows`` ``[N, S, ...]`` at ``positions`` ``[N, A, B]`` -> ``[N * A, B, ...]``."""
    N, A, B = positions.shape
    flat = (positions + mx.arange(N)[:, None, None] * rows.shape[1]).reshape(-1)
    taken = mx.take(rows.reshape(N * rows.shape[1], *rows.shape[2:]), flat, axis=0)
    return taken.reshape(N * A, B, *rows.shape[2:])


class OnlineTeacher:
    """Runs the target over each batch (no disk; the straightforward way)."""

    def __init__(self, target: TargetAdapter, draft_ids: np.ndarray | None):
        self.target = target
        self.draft_ids = draft_ids

    def __call__(
        self, indices: list[int], batch: Batch
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Features ``[N, S, F]``, target probabilities ``[N * A, B, V]`` and
        outside mass ``[N * A, B]`` for a batch."""
        hidden, features = self.target.hidden(batch.tokens, self.target.make_cache())
        # Once per token, then gathered: a token is in up to B blocks.
        probs, outside = target_distribution(self.target, hidden, self.draft_ids)
        out = (
            features.astype(mx.float32),
            _gather(mx.array(probs), batch.positions),
            _gather(mx.array(outside), batch.positions),
        )
        mx.eval(*out)
        return out


class TeacherStore:
    """The teacher of every sequence, computed once, memory-mapped."""

    def __init__(self, directory: Path):
        self.directory = directory
        meta = json.loads((directory / "meta.json").read_text())
        self.offsets = np.asarray(meta["offsets"], dtype=np.int64)
        self.lengths = np.asarray(meta["lengths"], dtype=np.int64)
        self.feature_dtype = meta["feature_dtype"]
        self.features = np.load(directory / "features.npy", mmap_mode="r")
        self.probs = np.load(directory / "probs.npy", mmap_mode="r")
        self.outside = np.load(directory / "outside.npy", mmap_mode="r")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.features, self.probs, self.outside))

    @staticmethod
    def complete(directory: Path, key: str) -> bool:
        try:
            meta = json.loads((directory / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        return meta.get("key") == key and meta.get("version") == STORE_VERSION

    @classmethod
    def build(
        cls,
        directory: Path,
        key: str,
        target: TargetAdapter,
        sequences: list[Sequence],
        draft_ids: np.ndarray | None,
        *,
        dtype: str = "float16",
        batch_size: int = 8,
        progress: Callable[[int, int], None] | None = None,
    ) -> TeacherStore:
        """Run the target once over ``sequences`` and return the opened store.

        The arrays are flushed and ``progress.json`` records the batches done
        after every batch, so a build that was interrupted (Ctrl-C, a killed
        session) continues where it stopped when called again with the same
        key, dtype and batch size; anything else starts over."""
        if cls.complete(directory, key):
            return cls(directory)
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        shape = {
            "total": int(lengths.sum()),
            "features": len(target.layer_ids) * target.hidden_size,
            "vocab": target.vocab_size if draft_ids is None else len(draft_ids),
        }
        exact = dtype == "float32"
        plan = {"version": STORE_VERSION, "key": key, "dtype": dtype}
        plan |= {"batch_size": batch_size, **shape}
        state = _read_progress(directory, plan)
        if state is None:
            state = {"feature_dtype": "float32" if exact else "float16", "done": 0}
        order = build_order(lengths)
        starts = range(0, len(order), batch_size)
        while True:
            if state["done"] == 0:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
            files = _open_arrays(directory, shape, state["feature_dtype"], exact)
            overflow = False
            for chunk_index in range(state["done"], len(starts)):
                start = starts[chunk_index]
                chunk = order[start : start + batch_size]
                S = int(lengths[chunk].max())
                tokens = np.zeros((len(chunk), S), dtype=np.int32)
                for row, i in enumerate(chunk):
                    tokens[row, : lengths[i]] = sequences[i].tokens
                rows = _teacher_rows(
                    target, tokens, draft_ids, state["feature_dtype"], exact
                )
                if rows is None:
                    overflow = True
                    break
                features, probs, outside = rows
                for row, i in enumerate(chunk):
                    rows = slice(offsets[i], offsets[i] + lengths[i])
                    files["features"][rows] = features[row, : lengths[i]]
                    files["probs"][rows] = probs[row, : lengths[i]]
                    files["outside"][rows] = outside[row, : lengths[i]]
                for array in files.values():
                    array.flush()
                state["done"] = chunk_index + 1
                write_text_atomic(
                    directory / "progress.json", json.dumps({**plan, **state})
                )
                if progress is not None:
                    progress(min(start + batch_size, len(order)), len(order))
            del files
            if not overflow:
                break
            state = {"feature_dtype": "bfloat16", "done": 0}
        meta = {
            "version": STORE_VERSION,
            "key": key,
            "offsets": offsets.tolist(),
            "lengths": lengths.tolist(),
            "feature_dtype": state["feature_dtype"],
            "vocab": shape["vocab"],
        }
        write_text_atomic(directory / "meta.json", json.dumps(meta))
        (directory / "progress.json").unlink()
        return cls(directory)

    def __call__(
        self, indices: list[int], batch: Batch
    ) -> tuple[mx.array, mx.array, mx.array]:
        """As :meth:`OnlineTeacher.__call__`, read from the store."""
        N, S = batch.tokens.shape
        F, V = self.features.shape[1], self.probs.shape[1]
        features = np.zeros((N, S, F), self.features.dtype)
        probs = np.zeros((N, S, V), self.probs.dtype)
        outside = np.zeros((N, S), np.float32)
        for row, i in enumerate(indices):
            rows = slice(self.offsets[i], self.offsets[i] + self.lengths[i])
            n = int(self.lengths[i])
            features[row, :n] = self.features[rows]
            probs[row, :n] = self.probs[rows]
            outside[row, :n] = self.outside[rows]
        features = mx.array(features)
        if self.feature_dtype == "bfloat16":
            features = features.view(mx.bfloat16)
        return (
            features.astype(mx.float32),
            _gather(mx.array(probs), batch.positions),
            _gather(mx.array(outside), batch.positions),
        )


def build_order(lengths: np.ndarray) -> np.ndarray:
    """The order a build runs the sequences in: longest first, so that a
    batch holds similar lengths."""
    return np.argsort(-lengths, kind="stable")


def _teacher_rows(
    target: TargetAdapter,
    tokens: np.ndarray,
    draft_ids: np.ndarray | None,
    feature_dtype: str,
    exact: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Features, probabilities and outside mass of a padded batch, in the
    store's dtypes; None when a feature overflows float16."""
    hidden, features = target.hidden(mx.array(tokens), target.make_cache())
    probs, outside = target_distribution(target, hidden, draft_ids)
    features = features.astype(mx.float32)
    if feature_dtype == "float16":
        if mx.abs(features).max().item() > F16_MAX:
            return None
        features = features.astype(mx.float16)
    elif feature_dtype == "bfloat16":
        features = features.astype(mx.bfloat16).view(mx.uint16)
    probs = probs.astype(np.float32 if exact else np.float16)
    return np.asarray(features), probs, outside


def _read_progress(directory: Path, plan: dict) -> dict | None:
    """The feature dtype and batches done of an interrupted build of ``plan``,
    or None when there is none to continue."""
    try:
        state = json.loads((directory / "progress.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if any(state.get(name) != value for name, value in plan.items()):
        return None
    if not all((directory / f"{name}.npy").exists() for name in ARRAYS):
        return None
    return {"feature_dtype": state["feature_dtype"], "done": int(state["done"])}


def _open_arrays(
    directory: Path, shape: dict, feature_dtype: str, exact: bool
) -> dict[str, np.memmap]:
    """The store's arrays, created when missing and opened for writing."""
    dtypes = {
        "features": {"float32": np.float32, "bfloat16": np.uint16}.get(
            feature_dtype, np.float16
        ),
        "probs": np.float32 if exact else np.float16,
        "outside": np.float32,
    }
    shapes = {
        "features": (shape["total"], shape["features"]),
        "probs": (shape["total"], shape["vocab"]),
        "outside": (shape["total"],),
    }
    files = {}
    for name in ARRAYS:
        path = directory / f"{name}.npy"
        if path.exists():
            files[name] = np.load(path, mmap_mode="r+")
        else:
            files[name] = np.lib.format.open_memmap(
                path, "w+", dtypes[name], shapes[name]
            )
    return files
