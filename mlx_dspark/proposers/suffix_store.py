"""Suffix store: model-free drafts from what the target has written.

SuffixDecoding (Oliaro et al., NeurIPS 2025; vLLM's ``suffix`` method from
Snowflake's ArcticInference) drafts from two indexes: one over the current
request (prompt and output so far) and a global one over previous responses,
updated token by token while they are written, so concurrent requests see
each other's text. Here:

- :class:`SuffixIndex` is the request's index: a growing token sequence.
- :class:`SuffixStore` is the global part: documents (responses, or phrases
  loaded from a ``phrases.npy``), bounded in tokens and documents, the oldest
  evicted first, saved to and loaded from one file keyed by the tokenizer.
- :class:`SuffixRequest` ties the two for one request and proposes drafts.

Matching finds the longest suffix of the context (at most ``max_depth``
tokens) that occurred earlier with a token after it. Its occurrences (the
``max_occurrences`` most recent) give a trie of continuations: a node's
probability is the product along its path of ``count(child) / count(parent)``,
where ``count(parent)`` counts the occurrences that go on past the parent
(the context's own end, or a document's end, is not a continuation). The draft
holds at most ``ceil(alpha * match_length)`` tokens (and ``max_draft``) and
never a node below ``min_prob``. A chain follows the most frequent child at
each step; a tree takes the nodes by decreasing probability (best-first
expansion), which keeps it closed under ancestors. Ties go to the continuation
seen most recently, then (tree) to the shallower node.

Why no suffix tree: a pure Python suffix tree costs tens of microseconds per
inserted token and depth, far too slow for a 20k-token prompt. Instead the
request and the live documents are scanned with numpy (nothing to build: a
prompt is indexed by copying it), and finished documents are frozen into runs
whose positions are sorted by the six tokens ending there, so a lookup is a
few binary searches and a vectorised backward comparison on the range found.
Token ids must be below 2**21 - 1 (:data:`MAX_TOKEN_ID`) for the sort keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DSparkError
from ..utils import write_atomic

_SEPARATOR = -1
PHRASES_FILE = "phrases.npy"
_FORMAT = "mlx-dspark suffix store"
_VERSION = 1


@dataclass(frozen=True)
class SuffixConfig:
    """How drafts are proposed.

    ``max_depth``: longest context suffix matched. ``alpha``: a match of ``m``
    tokens allows ``ceil(alpha * m)`` draft tokens (chain length or tree
    nodes), at most ``max_draft``. ``min_prob``: no draft node whose path
    probability is below it. ``min_match``: shorter matches give no draft.
    ``max_occurrences``: continuations counted over at most this many of the
    most recent occurrences of the matched suffix (bounds the cost of very
    frequent short matches).
    """

    max_depth: int = 64
    alpha: float = 1.0
    max_draft: int = 16
    min_prob: float = 0.1
    min_match: int = 1
    max_occurrences: int = 256

    def draft_budget(self, match_length: int, cap: int | None = None) -> int:
        """Draft tokens a match of ``match_length`` allows."""
        cap = self.max_draft if cap is None else cap
        return max(0, min(cap, math.ceil(self.alpha * match_length - 1e-9)))


@dataclass
class SuffixDraft:
    """A draft tree (a chain is a tree whose node i has parent i - 1).

    ``tokens``, ``parents`` (int32; -1 = the root, i.e. the last committed
    token; a parent always comes before its children) and ``probs`` (float32,
    the path probability of each node). ``score`` is the sum of ``probs``: the
    expected number of accepted tokens if the estimates were right.
    ``source`` is ``"request"``, ``"global"`` or ``""`` (empty draft).
    """

    tokens: np.ndarray
    parents: np.ndarray
    probs: np.ndarray
    match_length: int = 0
    source: str = ""

    @property
    def score(self) -> float:
        return float(self.probs.sum(dtype=np.float64))

    def __len__(self) -> int:
        return int(self.tokens.size)

    @classmethod
    def empty(cls) -> SuffixDraft:
        return cls(
            np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32)
        )


@dataclass
class _Group:
    """Occurrences in one token buffer: ``positions`` index the last matched
    token; ``docs``/``offsets`` order them by recency."""

    buffer: np.ndarray
    end: int
    positions: np.ndarray
    docs: np.ndarray
    offsets: np.ndarray


@dataclass
class SuffixMatch:
    """The longest matched suffix (``length`` tokens) and its occurrences."""

    length: int
    groups: list[_Group]

    @property
    def count(self) -> int:
        return sum(g.positions.size for g in self.groups)

    def windows(self, length: int, max_occurrences: int | None = None) -> np.ndarray:
        """int32 ``[occurrences, length]``: the tokens after each occurrence,
        -1 past its document's (or the written text's) end; most recent
        occurrence first, at most ``max_occurrences`` rows."""
        rows, docs, offsets = [], [], []
        for g in self.groups:
            rows.append(_continuations(g.buffer, g.end, g.positions, length))
            docs.append(g.docs)
            offsets.append(g.offsets)
        if not rows:
            return np.zeros((0, length), np.int32)
        window = np.concatenate(rows)
        recency = np.lexsort((-np.concatenate(offsets), -np.concatenate(docs)))
        if max_occurrences is not None:
            recency = recency[:max_occurrences]
        return window[recency]


# ---------------------------------------------------------------- primitives


class _Buffer:
    """A growable int32 token array (amortised O(1) append)."""

    def __init__(self, tokens: Sequence[int] | np.ndarray = ()) -> None:
        data = np.array(tokens, dtype=np.int32).ravel()
        self.data = np.full(max(16, 2 * data.size), _SEPARATOR, np.int32)
        self.data[: data.size] = data
        self.size = data.size

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int32).ravel()
        need = self.size + tokens.size
        if need > self.data.size:
            grown = np.full(max(need, 2 * self.data.size), _SEPARATOR, np.int32)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size : need] = tokens
        self.size = need

    def append(self, token: int) -> None:
        if self.size == self.data.size:
            self.extend([token])
            return
        self.data[self.size] = token
        self.size += 1

    @property
    def tokens(self) -> np.ndarray:
        return self.data[: self.size]


def _reversed_context(context: Sequence[int] | np.ndarray, depth: int) -> np.ndarray:
    tail = np.asarray(context[-depth:] if depth > 0 else [], dtype=np.int32)
    return tail[::-1].copy()


def _match_lengths(
    buffer: np.ndarray, positions: np.ndarray, rev: np.ndarray, done: int
) -> np.ndarray:
    """How many tokens backwards from each position equal ``rev`` (the
    context reversed), given that the first ``done`` already do. Separators
    (-1) and the buffer's start never match. Compared in chunks that double,
    keeping only the positions that matched a whole chunk."""
    lengths = np.full(positions.size, done, np.int64)
    active = np.arange(positions.size)
    j, chunk = done, 4
    while active.size and j < rev.size:
        k = min(chunk, rev.size - j)
        index = positions[active, None] - (j + np.arange(k))
        equal = (buffer[np.maximum(index, 0)] == rev[j : j + k]) & (index >= 0)
        run = np.logical_and.accumulate(equal, axis=1).sum(axis=1)
        lengths[active] += run
        active = active[run == k]
        j, chunk = j + k, chunk * 2
    return lengths


def _continuations(
    buffer: np.ndarray, end: int, positions: np.ndarray, length: int
) -> np.ndarray:
    index = positions[:, None] + 1 + np.arange(length)
    values = np.where(index < end, buffer[np.minimum(index, end - 1)], _SEPARATOR)
    going = np.logical_and.accumulate(values >= 0, axis=1)
    return np.where(going, values, _SEPARATOR).astype(np.int32)


def _scan(buffer: np.ndarray, end: int, rev: np.ndarray) -> tuple[int, np.ndarray]:
    """Brute force: the longest match at positions < end - 1 with a token
    after them, and those positions."""
    if rev.size == 0 or end < 2:
        return 0, np.zeros(0, np.int64)
    candidates = np.flatnonzero(buffer[: end - 1] == rev[0])
    if candidates.size == 0:
        return 0, candidates
    candidates = candidates[buffer[candidates + 1] >= 0]
    if candidates.size == 0:
        return 0, candidates
    lengths = _match_lengths(buffer, candidates, rev, 1)
    best = int(lengths.max())
    return best, candidates[lengths == best]


# ---------------------------------------------------------------- request


class SuffixIndex:
    """The request's index: prompt and output so far, one growing sequence.

    Nothing is built: each match scans the tokens with numpy (about
    10 microseconds for 20k tokens), so indexing a prompt is a copy and
    appending a token is an array store.
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray = ()) -> None:
        self._buffer = _Buffer(tokens)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        self._buffer.extend(tokens)

    def append(self, token: int) -> None:
        self._buffer.append(token)

    @property
    def tokens(self) -> np.ndarray:
        return self._buffer.tokens

    def __len__(self) -> int:
        return self._buffer.size

    def match(
        self,
        context: Sequence[int] | np.ndarray,
        max_depth: int = 64,
        max_occurrences: int | None = None,
    ) -> SuffixMatch | None:
        """The longest suffix of ``context`` (at most ``max_depth`` tokens)
        that occurs here followed by a token, with its occurrences (all, or
        the ``max_occurrences`` most recent); None when not even its last
        token does."""
        rev = _reversed_context(context, max_depth)
        data, size = self._buffer.data, self._buffer.size
        length, positions = _scan(data, size, rev)
        if length == 0:
            return None
        positions = _recent(positions, max_occurrences)
        zeros = np.zeros(positions.size, np.int64)
        return SuffixMatch(length, [_Group(data, size, positions, zeros, positions)])


# ---------------------------------------------------------------- global


_BITS = 21  # bits per token in a sort key: ids below 2**21 - 1
_PER_KEY = 3  # tokens per uint64 key
MAX_TOKEN_ID = (1 << _BITS) - 2


def _pack(tokens: np.ndarray) -> int:
    """Up to three tokens (+ 1 each) as one key prefix."""
    key = 0
    for t in tokens.tolist():
        key = (key << _BITS) | (t + 1)
    return key


def _key_range(
    keys: np.ndarray, lo: int, hi: int, tokens: np.ndarray
) -> tuple[int, int]:
    """The positions in ``[lo, hi)`` whose key starts with ``tokens``."""
    free = _BITS * (_PER_KEY - tokens.size)
    low = np.uint64(_pack(tokens) << free)
    high = np.uint64((_pack(tokens) << free) | ((1 << free) - 1))
    segment = keys[lo:hi]
    return (
        lo + int(np.searchsorted(segment, low, "left")),
        lo + int(np.searchsorted(segment, high, "right")),
    )


def _recent(positions: np.ndarray, limit: int | None) -> np.ndarray:
    """The ``limit`` largest positions (the most recent in id-ordered text)."""
    if limit is None or positions.size <= limit:
        return positions
    return np.partition(positions, positions.size - limit)[-limit:]


@dataclass
class _Run:
    """Finished documents in id order, each followed by -1.

    Once frozen, ``order`` lists the positions that have a token after them,
    sorted by the six tokens ending there, read backwards (``keys``: two
    uint64 columns of three 21-bit tokens + 1; a separator is 0, which no
    context token equals, so what lies before it never matters). A context's last six tokens then narrow to a range by binary
    search; longer matches are checked on that range only. Because documents
    are in id order and the oldest are evicted first, the live positions are
    those from ``alive_from`` on.
    """

    tokens: np.ndarray
    starts: np.ndarray  # int64: start of each document in tokens
    ids: np.ndarray  # int64: each document's id, increasing
    order: np.ndarray | None = None
    keys: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def from_documents(cls, docs: list[tuple[int, np.ndarray]]) -> _Run:
        docs = sorted(docs, key=lambda item: item[0])
        lengths = np.array([d.size + 1 for _, d in docs], np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        parts = []
        for _, d in docs:
            parts += [d.astype(np.int32), np.array([_SEPARATOR], np.int32)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        ids = np.array([i for i, _ in docs], np.int64)
        return cls(tokens, starts, ids)

    def freeze(self) -> None:
        n = self.tokens.size
        if n and int(self.tokens.max()) > MAX_TOKEN_ID:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        values = (self.tokens.astype(np.int64) + 1).astype(np.uint64)
        columns = []
        for c in range(2):
            key = np.zeros(n, np.uint64)
            for k in range(_PER_KEY):
                back = c * _PER_KEY + k
                shifted = np.zeros(n, np.uint64)
                if back < n:
                    shifted[back:] = values[: n - back]
                key = (key << np.uint64(_BITS)) | shifted
            columns.append(key)
        has_next = np.zeros(n, bool)
        has_next[:-1] = (self.tokens[:-1] >= 0) & (self.tokens[1:] >= 0)
        where = np.flatnonzero(has_next)
        sort = np.lexsort((columns[1][where], columns[0][where]))
        self.order = where[sort].astype(np.int32)
        self.keys = (columns[0][self.order], columns[1][self.order])

    def documents(self, first_alive: int) -> list[tuple[int, np.ndarray]]:
        ends = np.append(self.starts[1:], self.tokens.size) - 1
        return [
            (int(i), self.tokens[s:e])
            for i, s, e in zip(self.ids, self.starts, ends, strict=True)
            if i >= first_alive
        ]

    def alive_tokens(self, first_alive: int) -> int:
        ends = np.append(self.starts[1:], self.tokens.size) - 1
        return int((ends - self.starts)[self.ids >= first_alive].sum())

    def alive_from(self, first_alive: int) -> int:
        doc = int(np.searchsorted(self.ids, first_alive, "left"))
        return int(self.starts[doc]) if doc < self.ids.size else self.tokens.size

    def _group(self, positions: np.ndarray) -> _Group:
        doc = np.searchsorted(self.starts, positions, side="right") - 1
        offsets = positions - self.starts[doc]
        return _Group(self.tokens, self.tokens.size, positions, self.ids[doc], offsets)

    def match(
        self, rev: np.ndarray, first_alive: int, limit: int | None
    ) -> tuple[int, _Group | None]:
        """The longest match among this run's live documents and its (at most
        ``limit`` most recent) occurrences."""
        if rev.size == 0 or self.tokens.size == 0:
            return 0, None
        if self.keys is None:  # pending: small, no evicted documents, scanned
            length, positions = _scan(self.tokens, self.tokens.size, rev)
            if length == 0:
                return 0, None
            return length, self._group(_recent(positions, limit))
        ranges = [(0, self.order.size)]
        for d in range(1, min(rev.size, 2 * _PER_KEY) + 1):
            column = 0 if d <= _PER_KEY else 1
            lo, hi = ranges[_PER_KEY] if column else (0, self.order.size)
            tokens = rev[column * _PER_KEY : d]
            lo, hi = _key_range(self.keys[column], lo, hi, tokens)
            if lo == hi:
                break
            ranges.append((lo, hi))
        start = self.alive_from(first_alive)
        for depth in range(len(ranges) - 1, 0, -1):
            lo, hi = ranges[depth]
            positions = self.order[lo:hi].astype(np.int64)
            positions = positions[positions >= start]
            if positions.size:
                break
        else:
            return 0, None
        if depth == 2 * _PER_KEY and rev.size > depth:
            lengths = _match_lengths(self.tokens, positions, rev, depth)
            depth = int(lengths.max())
            positions = positions[lengths == depth]
        return depth, self._group(_recent(positions, limit))


@dataclass
class SuffixStore:
    """The global part: previous (and live) responses, bounded.

    Documents get increasing ids in the order they are opened; past
    ``max_tokens`` tokens or ``max_documents`` documents the oldest are
    evicted first (a live one too: later tokens for it are then dropped).
    Finished documents wait in a pending run (scanned) until it holds
    ``freeze_tokens`` tokens, then are frozen into a sorted run; runs of
    similar size are merged, evicted documents dropped as they are.
    Not thread-safe: the caller serialises calls.
    """

    max_tokens: int = 2_000_000
    max_documents: int = 100_000
    freeze_tokens: int = 8192
    _runs: list[_Run] = field(default_factory=list, repr=False)
    _pending: list[tuple[int, np.ndarray]] = field(default_factory=list, repr=False)
    _pending_run: _Run | None = field(default=None, repr=False)
    _live: dict[int, _Buffer] = field(default_factory=dict, repr=False)
    _lengths: dict[int, int] = field(default_factory=dict, repr=False)
    _next_id: int = field(default=0, repr=False)
    _first_alive: int = field(default=0, repr=False)
    _tokens: int = field(default=0, repr=False)

    # -- writing

    def open(self, tokens: Sequence[int] | np.ndarray = ()) -> int:
        """Start a live document (a response being written); returns its id."""
        doc = self._next_id
        self._next_id += 1
        self._live[doc] = _Buffer(tokens)
        self._lengths[doc] = self._live[doc].size
        self._tokens += self._live[doc].size
        self._evict()
        return doc

    def extend(self, doc: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Append tokens to live document ``doc`` (ignored once evicted)."""
        buffer = self._live.get(doc)
        if buffer is None:
            return
        before = buffer.size
        buffer.extend(tokens)
        self._lengths[doc] += buffer.size - before
        self._tokens += buffer.size - before
        if buffer.size > before:
            self._evict()

    def append(self, doc: int, token: int) -> None:
        buffer = self._live.get(doc)
        if buffer is None:
            return
        buffer.append(token)
        self._lengths[doc] += 1
        self._tokens += 1
        if self._tokens > self.max_tokens:
            self._evict()

    def close(self, doc: int) -> None:
        """Document ``doc`` is finished: it moves to the pending run."""
        buffer = self._live.pop(doc, None)
        if buffer is None:
            return
        self._pending.append((doc, buffer.tokens.copy()))
        self._pending_run = None
        if sum(d.size for _, d in self._pending) >= self.freeze_tokens:
            self._freeze_pending()

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> int:
        doc = self.open(tokens)
        self.close(doc)
        return doc

    def add_documents(self, documents: Iterable[Sequence[int] | np.ndarray]) -> None:
        """Add finished documents at once (oldest first), frozen into one run:
        cheaper than :meth:`add_document` one by one for a large set."""
        docs = []
        for d in documents:
            d = np.asarray(d, dtype=np.int32).ravel()
            if d.size and (d.min() < 0 or d.max() > MAX_TOKEN_ID):
                raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
            docs.append((self._next_id, d))
            self._lengths[self._next_id] = d.size
            self._tokens += d.size
            self._next_id += 1
        self._freeze_pending()
        if docs:
            run = _Run.from_documents(docs)
            run.freeze()
            self._runs.append(run)
        self._evict()
        self._compact()

    def add_phrases(self, path: str | Path) -> int:
        """Add the documents of a phrase store (``phrases.npy``, see
        :func:`write_phrases`); returns how many."""
        documents = read_phrases(path)
        self.add_documents(documents)
        return len(documents)

    # -- reading

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def document_ids(self) -> list[int]:
        """Ids of the stored documents, oldest first."""
        return list(self._lengths)

    def documents(self) -> list[np.ndarray]:
        """The stored documents (live ones as written so far), oldest first."""
        found: dict[int, np.ndarray] = {}
        for run in self._runs:
            found.update(run.documents(self._first_alive))
        found.update((i, d) for i, d in self._pending)
        found.update((i, b.tokens) for i, b in self._live.items())
        return [found[i].copy() for i in self._lengths]

    def match(
        self,
        context: Sequence[int] | np.ndarray,
        max_depth: int = 64,
        max_occurrences: int | None = None,
        exclude: int | None = None,
    ) -> SuffixMatch | None:
        """The longest suffix of ``context`` (at most ``max_depth`` tokens)
        that occurs in a stored document followed by a token, with its
        occurrences (all, or at least the ``max_occurrences`` most recent);
        None when not even the last token does. ``exclude``: a live document
        left out (a request's own, which its own index holds already)."""
        rev = _reversed_context(context, max_depth)
        found: list[tuple[int, _Group]] = []
        for run in self._runs:
            found.append(run.match(rev, self._first_alive, max_occurrences))
        pending = self._pending_view()
        if pending is not None:
            found.append(pending.match(rev, self._first_alive, max_occurrences))
        for doc, buffer in self._live.items():
            if doc == exclude:
                continue
            length, positions = _scan(buffer.data, buffer.size, rev)
            if length:
                positions = _recent(positions, max_occurrences)
                docs = np.full(positions.size, doc, np.int64)
                group = _Group(buffer.data, buffer.size, positions, docs, positions)
                found.append((length, group))
        best = max((length for length, _ in found), default=0)
        if best == 0:
            return None
        return SuffixMatch(best, [g for length, g in found if length == best])

    # -- persistence

    def save(self, path: str | Path, fingerprint: str) -> None:
        """Write the stored documents (live ones as written so far) to one
        file, tagged with ``fingerprint`` (the caller's tokenizer identity),
        atomically: a reader sees the old file or the new one."""
        documents = self.documents()
        lengths = np.array([d.size for d in documents], np.int64)
        tokens = (
            np.concatenate(documents).astype(np.int32)
            if documents
            else np.zeros(0, np.int32)
        )
        arrays = {
            "format": np.frombuffer(_FORMAT.encode(), np.uint8),
            "version": np.array([_VERSION], np.int64),
            "fingerprint": np.frombuffer(fingerprint.encode(), np.uint8),
            "lengths": lengths,
            "tokens": tokens,
        }

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as file:
                np.savez(file, **arrays)

        write_atomic(path, write)

    @classmethod
    def load(
        cls,
        path: str | Path,
        fingerprint: str,
        max_tokens: int = 2_000_000,
        max_documents: int = 100_000,
        freeze_tokens: int = 8192,
    ) -> SuffixStore:
        """Read a store :meth:`save` wrote with the same ``fingerprint``.

        Raises :class:`DSparkError` (one sentence) when the file is missing,
        corrupt, truncated, not a suffix store, or written for another
        tokenizer; the caller then starts a fresh store.
        """
        documents = _read_store(Path(path), fingerprint)
        store = cls(max_tokens, max_documents, freeze_tokens)
        store.add_documents(documents)
        return store

    # -- internals

    def _pending_view(self) -> _Run | None:
        if not self._pending:
            return None
        if self._pending_run is None:
            self._pending_run = _Run.from_documents(self._pending)
        return self._pending_run

    def _freeze_pending(self) -> None:
        run = self._pending_view()
        self._pending, self._pending_run = [], None
        if run is None:
            return
        run.freeze()
        self._runs.append(run)
        self._compact()

    def _compact(self) -> None:
        """Drop dead runs; merge the newest run into the one before it while
        that one is at most twice its size (geometric sizes: log-many runs,
        each token re-sorted log-many times)."""
        alive = self._first_alive
        self._runs = [r for r in self._runs if r.ids.size and r.ids.max() >= alive]
        while len(self._runs) >= 2:
            last, before = self._runs[-1], self._runs[-2]
            if before.alive_tokens(alive) > 2 * last.alive_tokens(alive):
                break
            docs = before.documents(alive) + last.documents(alive)
            docs.sort(key=lambda item: item[0])
            merged = _Run.from_documents(docs)
            merged.freeze()
            self._runs[-2:] = [merged]

    def _evict(self) -> None:
        """Past a bound, drop the oldest documents (strictly by age: a live
        one too, even the one being written)."""
        evicted = False
        while self._lengths and (
            self._tokens > self.max_tokens or len(self._lengths) > self.max_documents
        ):
            doc = next(iter(self._lengths))
            self._tokens -= self._lengths.pop(doc)
            self._live.pop(doc, None)
            self._first_alive = doc + 1
            evicted = True
        if evicted:
            before = len(self._pending)
            self._pending = [(i, d) for i, d in self._pending if i >= self._first_alive]
            if len(self._pending) != before:
                self._pending_run = None
            self._runs = [
                r for r in self._runs if r.ids.size and r.ids.max() >= self._first_alive
            ]


def write_phrases(path: str | Path, documents: Iterable[Sequence[int]]) -> None:
    """Write documents as a ``phrases.npy``: token ids + 1, 0 after each
    document, in 16 bits when they fit (temporary file, then rename)."""
    parts = [np.append(np.asarray(d, np.int64) + 1, 0) for d in documents]
    values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    small = values.size == 0 or values.max() <= np.iinfo(np.uint16).max

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as file:
            np.save(file, values.astype(np.uint16 if small else np.uint32))

    write_atomic(path, write)


def phrase_store(path: str | Path) -> SuffixStore:
    """The documents of a ``phrases.npy`` as a pre-filled global store,
    large enough to hold them all."""
    documents = read_phrases(path)
    size = sum(d.size for d in documents)
    store = SuffixStore(max(2_000_000, size), max(100_000, len(documents)))
    store.add_documents(documents)
    return store


def read_phrases(path: str | Path) -> list[np.ndarray]:
    """The documents of a ``phrases.npy`` (a 1-D unsigned array of token
    ids + 1, 0 after each document: :func:`write_phrases`)."""
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise DSparkError(
            f"The phrase store {path} cannot be read ({error})."
        ) from None
    if (
        values.ndim != 1
        or values.dtype.kind != "u"
        or (values.size and values[-1] != 0)
    ):
        raise DSparkError(
            f"The phrase store {path} is not a 1-D array of token ids + 1 "
            "with 0 after each document."
        )
    ids = values.astype(np.int64) - 1
    ends = np.flatnonzero(ids < 0)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e].astype(np.int32) for s, e in zip(starts, ends, strict=True)]


def _read_store(path: Path, fingerprint: str) -> list[np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise DSparkError(f"There is no suffix store at {path}.") from None
    except Exception:
        raise DSparkError(
            f"The suffix store {path} is corrupt or truncated; it was not used."
        ) from None
    names = {"format", "version", "fingerprint", "lengths", "tokens"}
    if not isinstance(arrays, dict) or set(arrays) != names:
        raise DSparkError(f"The file {path} is not a suffix store; it was not used.")
    if bytes(arrays["format"].astype(np.uint8)) != _FORMAT.encode() or list(
        arrays["version"]
    ) != [_VERSION]:
        raise DSparkError(f"The file {path} is not a suffix store; it was not used.")
    if bytes(arrays["fingerprint"].astype(np.uint8)) != fingerprint.encode():
        raise DSparkError(
            f"The suffix store {path} was written for another tokenizer; "
            "it was not used."
        )
    lengths, tokens = arrays["lengths"], arrays["tokens"]
    if (
        lengths.ndim != 1
        or tokens.ndim != 1
        or lengths.dtype.kind not in "iu"
        or tokens.dtype.kind not in "iu"
        or (lengths.size and lengths.min() < 0)
        or int(lengths.sum()) != tokens.size
        or (tokens.size and tokens.min() < 0)
    ):
        raise DSparkError(
            f"The suffix store {path} is corrupt or truncated; it was not used."
        )
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return [
        tokens[s:e].astype(np.int32)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]


# ---------------------------------------------------------------- drafting


def _sort_rows(windows: np.ndarray) -> np.ndarray:
    """A stable lexicographic order of the rows, three tokens per sort key."""
    values = (windows.astype(np.int64) + 1).astype(np.uint64)
    keys = []
    for c in range(0, values.shape[1], _PER_KEY):
        key = np.zeros(values.shape[0], np.uint64)
        for k in range(c, c + _PER_KEY):
            column = values[:, k] if k < values.shape[1] else 0
            key = (key << np.uint64(_BITS)) | column
        keys.append(key)
    return np.lexsort(keys[::-1])


def draft_from_windows(
    windows: np.ndarray, max_tokens: int, min_prob: float, tree: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, parents, probs)`` of the draft the continuations give.

    ``windows``: int32 ``[occurrences, L]``, most recent occurrence first,
    -1 after an occurrence's end. The trie of the rows is built at once
    (rows sorted, node = first row of each group of equal prefixes), so the
    cost does not grow with a Python loop over nodes.
    """
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))
    rows, depth = windows.shape
    depth = min(depth, max_tokens)
    if rows == 0 or depth == 0 or max_tokens <= 0:
        return empty
    windows = windows[:, :depth]
    if rows == 1:
        valid = windows[0] >= 0
        n = int(np.logical_and.accumulate(valid).sum())
        if min_prob > 1.0:
            n = 0
        tokens = windows[0, :n].astype(np.int32)
        return tokens, np.arange(-1, n - 1, dtype=np.int32), np.ones(n, np.float32)
    order = _sort_rows(windows)
    w = windows[order]
    new = np.ones((rows, depth), bool)
    new[1:] = np.logical_or.accumulate(w[1:] != w[:-1], axis=1)
    leader = np.maximum.accumulate(np.where(new, np.arange(rows)[:, None], 0), axis=0)
    node = leader * depth + np.arange(depth)  # one key per trie node
    valid = w >= 0
    count = np.bincount(node[valid], minlength=rows * depth)
    going = np.bincount(node[:, :-1][valid[:, 1:]], minlength=rows * depth)
    parent_going = np.empty((rows, depth), np.float64)
    parent_going[:, 0] = valid[:, 0].sum()
    parent_going[:, 1:] = going[node[:, :-1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(valid, count[node] / parent_going, 0.0)
    prob = np.cumprod(ratio, axis=1)
    # Only nodes at or above min_prob can be drafted (a node's children are
    # never more probable than it): the rest is dropped before the
    # per-node work.
    kept = valid & (prob >= min_prob)
    cells = np.flatnonzero((new & kept).ravel())
    if cells.size == 0:
        return empty
    recency = np.full(rows * depth, rows, np.int64)
    np.minimum.at(recency, node[kept], np.broadcast_to(order[:, None], w.shape)[kept])
    n_prob = prob.ravel()[cells]
    n_depth = cells % depth
    n_key = node.ravel()[cells]
    n_token = w.ravel()[cells]
    # The cell before in the same row holds the parent node's key.
    n_parent = np.where(n_depth > 0, node.ravel()[np.maximum(cells - 1, 0)], -1)
    n_recency = recency[n_key]
    if tree:
        pick = np.lexsort((n_recency, n_depth, -n_prob))[:max_tokens]
    else:
        # Chain: from the root, the child with the most occurrences (then the
        # most recent), while its probability stays at or above min_prob.
        best = np.lexsort((n_recency, -n_prob, n_parent))
        first = np.ones(best.size, bool)
        first[1:] = n_parent[best][1:] != n_parent[best][:-1]
        child = dict(
            zip(n_parent[best][first].tolist(), best[first].tolist(), strict=True)
        )
        path, at = [], -1
        while len(path) < max_tokens and at in child:
            path.append(child[at])
            at = int(n_key[path[-1]])
        pick = np.array(path, np.int64)
    if pick.size == 0:
        return empty
    index = {int(k): j for j, k in enumerate(n_key[pick].tolist())}
    parents = np.array([index.get(int(p), -1) for p in n_parent[pick]], np.int32)
    return (
        n_token[pick].astype(np.int32),
        parents,
        n_prob[pick].astype(np.float32),
    )


def draft_from_match(
    match: SuffixMatch | None,
    config: SuffixConfig,
    tree: bool,
    max_tokens: int | None = None,
    source: str = "",
) -> SuffixDraft:
    """The draft a match gives under ``config`` (``max_tokens`` overrides
    ``config.max_draft`` as the cap)."""
    if match is None or match.length < config.min_match:
        return SuffixDraft.empty()
    budget = config.draft_budget(match.length, max_tokens)
    if budget == 0:
        return SuffixDraft.empty()
    windows = match.windows(budget, config.max_occurrences)
    tokens, parents, probs = draft_from_windows(windows, budget, config.min_prob, tree)
    if tokens.size == 0:
        return SuffixDraft.empty()
    return SuffixDraft(tokens, parents, probs, match.length, source)


class SuffixRequest:
    """One request: its own index over prompt + output, and (when a global
    store is given) a live document there holding its output, so other
    requests draft from it while it is written.

    Call :meth:`extend` with the tokens the target commits, :meth:`propose`
    before each round, :meth:`close` at the end (the output stays in the
    global store until evicted).
    """

    def __init__(
        self,
        prompt: Sequence[int] | np.ndarray,
        store: SuffixStore | None = None,
        config: SuffixConfig | None = None,
    ) -> None:
        self.config = config or SuffixConfig()
        self.index = SuffixIndex(prompt)
        self.store = store
        self.doc = store.open() if store is not None else None

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        self.index.extend(tokens)
        if self.store is not None and self.doc is not None:
            self.store.extend(self.doc, tokens)

    def append(self, token: int) -> None:
        self.index.append(token)
        if self.store is not None and self.doc is not None:
            self.store.append(self.doc, token)

    def propose(self, tree: bool = False, max_tokens: int | None = None) -> SuffixDraft:
        """The better (higher :attr:`SuffixDraft.score`; the request's on a
        tie) of the drafts from the request's index and the global store
        (other documents than the request's own: ``source`` "global" is
        always text written elsewhere)."""
        context = self.index.tokens
        depth = self.config.max_depth
        found = self.index.match(context, depth, self.config.max_occurrences)
        local = draft_from_match(found, self.config, tree, max_tokens, "request")
        if self.store is None:
            return local
        found = self.store.match(
            context, depth, self.config.max_occurrences, exclude=self.doc
        )
        shared = draft_from_match(found, self.config, tree, max_tokens, "global")
        return local if local.score >= shared.score else shared

    def close(self) -> None:
        if self.store is not None and self.doc is not None:
            self.store.close(self.doc)
        self.doc = None


def best_chain(
    request: SuffixRequest, store: SuffixStore | None, size: int
) -> SuffixDraft:
    """The better chain (higher score, the request's on a tie) of the
    request's index and ``store``, at most ``size`` tokens. ``store`` is read
    only: unlike the request's own global store, nothing is written to it."""
    size = max(0, min(size, request.config.max_draft))
    local = request.propose(max_tokens=size)
    if store is None or size == 0:
        return local
    config, context = request.config, request.index.tokens
    found = store.match(context, config.max_depth, config.max_occurrences)
    shared = draft_from_match(found, config, False, size, "global")
    return local if local.score >= shared.score else shared


def padded(draft: SuffixDraft, length: int) -> np.ndarray:
    """A chain's first ``length`` tokens as int32 ``[length]``, -1 past its end."""
    out = np.full(length, -1, np.int32)
    n = min(length, len(draft))
    out[:n] = draft.tokens[:n]
    return out


def context_copy(
    context: Sequence[int] | np.ndarray, length: int, config: SuffixConfig
) -> np.ndarray:
    """The chain the context's own text proposes after its end, :func:`padded`
    to ``length``. Where the chain stops short it goes on with the chain the
    context followed by it proposes, as text that repeats itself would (a
    loop whose copy reaches the end of the text repeats with its period)."""
    tokens = np.asarray(context, np.int64)
    copied: list[int] = []
    while tokens.size and len(copied) < length:
        index = SuffixIndex(tokens)
        found = index.match(tokens, config.max_depth, config.max_occurrences)
        more = draft_from_match(found, config, False, length - len(copied))
        if len(more) == 0:
            break
        copied += more.tokens.tolist()
        tokens = np.concatenate([tokens, more.tokens.astype(np.int64)])
    out = np.full(length, -1, np.int32)
    out[: len(copied)] = copied
    return out


def store_copy(
    store: SuffixStore,
    context: Sequence[int] | np.ndarray,
    length: int,
    config: SuffixConfig,
) -> np.ndarray:
    """The chain ``store`` proposes after the context's end, :func:`padded` to
    ``length``."""
    found = store.match(context, config.max_depth, config.max_occurrences)
    return padded(draft_from_match(found, config, False, length, "global"), length)


@dataclass
class SuffixState:
    """One generation's suffix index: the request (made at the first offer)
    and how many committed tokens it holds."""

    request: SuffixRequest | None = None
    seen: int = 0

    def sync(
        self, tokens: list[int], store: SuffixStore | None, config: SuffixConfig
    ) -> SuffixRequest:
        """The request's index holding every committed token of ``tokens``:
        at the first call the prompt is all but the last token (the loop asks
        for offers once the first token is generated), later calls append
        only what is new."""
        if self.request is None:
            self.request = SuffixRequest(tokens[:-1], store, config)
            self.seen = len(tokens) - 1
        if len(tokens) > self.seen:
            self.request.extend(tokens[self.seen :])
            self.seen = len(tokens)
        return self.request
