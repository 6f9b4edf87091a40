"""Where suffix stores live: per process, and on disk between runs.

A :class:`~mlx_dspark.proposers.suffix_store.SuffixStore` holds token ids, so
it belongs to a tokenizer, not to a model: a file is keyed by
:func:`tokenizer_fingerprint` (a hash of the tokenizer's vocabulary), and the
process keeps its stores on the tokenizer object the caller holds
(:func:`process_store`), never in module state.

``suffix_store`` names (the ``stream_generate`` keyword; the CLI's
``--dspark-suffix-store`` takes ``auto``, ``none`` or a path):

- ``"process"``: an in-memory store kept on the tokenizer object, so that
  later generations with the same tokenizer object draft from earlier ones;
  never written to disk.
- ``"auto"``: the same, read at first use from :func:`default_store_path`
  (``cache_dir()/suffix/<fingerprint>.npz``) and written back atomically.
- a path: the same with that file.
- ``"none"`` (or None): the request's own index only.

A store file that cannot be used (corrupt, truncated, not a store, another
tokenizer's) is moved aside to ``<name>.bad`` (``<name>.bad.1``, ... when that
exists), never overwritten, and a fresh store starts; :func:`open_store`
returns the one sentence that says so.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DSparkError
from ..utils import cache_dir
from .suffix_store import SuffixStore

# The bound of the stores made here (SuffixStore's defaults): 2M tokens,
# about 50 MB in memory and 8 MB on disk; the oldest documents go first.
STORE_TOKENS = 2_000_000
STORE_DOCUMENTS = 100_000

_ATTRIBUTE = "dspark_suffix_stores"
SCOPES = ("global", "request")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary (its sorted ``(piece, id)`` pairs):
    equal for the same tokenizer whatever model it came with."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    vocab = inner.get_vocab()
    items = sorted((str(piece), int(i)) for piece, i in vocab.items())
    data = json.dumps(items, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:32]


def default_store_path(fingerprint: str) -> Path:
    """``cache_dir()/suffix/<fingerprint>.npz``."""
    return cache_dir() / "suffix" / f"{fingerprint}.npz"


def _aside(path: Path) -> Path:
    """A name beside ``path`` that holds nothing yet: ``<name>.bad``, then
    ``<name>.bad.1``, ..."""
    candidate = path.with_name(path.name + ".bad")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.bad.{n}")
        n += 1
    return candidate


def open_store(
    path: str | Path,
    fingerprint: str,
    max_tokens: int = STORE_TOKENS,
    max_documents: int = STORE_DOCUMENTS,
) -> tuple[SuffixStore, str | None]:
    """The store saved at ``path`` for ``fingerprint``, and a note (None when
    all went well). No file: a fresh store, no note. A file that cannot be
    used: it is moved aside (see the module), a fresh store starts, and the
    note says so in one sentence."""
    path = Path(path)
    fresh = SuffixStore(max_tokens, max_documents)
    if not path.exists():
        return fresh, None
    try:
        return SuffixStore.load(path, fingerprint, max_tokens, max_documents), None
    except DSparkError as error:
        reason = str(error).removesuffix(" it was not used.").rstrip("; .")
    bad = _aside(path)
    try:
        os.replace(path, bad)
    except OSError:
        return fresh, (
            f"{reason}; it could not be moved aside, so a fresh suffix store "
            "is used and not saved."
        )
    return fresh, f"{reason}; it was moved to {bad} and a fresh suffix store started."


@dataclass
class ProcessStore:
    """A store kept for the process, and where it is saved (None: nowhere).
    ``note``: what opening it found (once)."""

    store: SuffixStore
    path: Path | None = None
    fingerprint: str = ""
    note: str | None = None
    saveable: bool = True

    def save(self) -> str | None:
        """Write the store atomically to its file (if it has one); a sentence
        when that failed (the old file is then left as it was)."""
        if self.path is None or not self.saveable:
            return None
        try:
            self.store.save(self.path, self.fingerprint)
        except OSError as error:
            return f"The suffix store could not be saved to {self.path}: {error}."
        return None


def store_location(tokenizer: Any, name: str | os.PathLike) -> tuple[Path, str]:
    """``(path, fingerprint)`` of ``"auto"`` or a path, for ``tokenizer``."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if str(name) == "auto":
        return default_store_path(fingerprint), fingerprint
    return Path(name).expanduser(), fingerprint


def process_store(holder: Any, tokenizer: Any, name: str | os.PathLike) -> ProcessStore:
    """The store ``name`` (``"process"``, ``"auto"`` or a path) kept on
    ``holder`` (the tokenizer object the caller passed): made, or read from
    its file, at first use; the same object afterwards."""
    stores = getattr(holder, _ATTRIBUTE, None)
    if stores is None:
        stores = {}
        setattr(holder, _ATTRIBUTE, stores)
    if str(name) == "process":
        key = "process"
    else:
        path, fingerprint = store_location(tokenizer, name)
        key = str(path.resolve())
    found = stores.get(key)
    if found is not None:
        return found
    if key == "process":
        found = ProcessStore(SuffixStore(STORE_TOKENS, STORE_DOCUMENTS))
    else:
        store, note = open_store(path, fingerprint)
        saveable = note is None or "moved to" in note
        found = ProcessStore(store, path, fingerprint, note, saveable)
    stores[key] = found
    return found


def resolve_store_name(value: Any) -> str | SuffixStore | None:
    """``suffix_store`` as given: a SuffixStore, None for none, else the name;
    a bad value is refused in one sentence."""
    if value is None or isinstance(value, SuffixStore):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str) or not value:
        raise DSparkError(
            "suffix_store must be a SuffixStore, 'process', 'auto', 'none' or a "
            f"file path, got {value!r}."
        )
    return None if value == "none" else value
