"""Training data for DSpark drafters: reading, tokenising and regenerating.

Accepted inputs:

* plain text files (any extension but ``.jsonl``): tokenised whole and cut
  into ``seq_len`` chunks, every token a training target;
* either kind gzip-compressed (``.gz`` appended: ``answers.jsonl.gz``);
* JSONL files, one object per line, with one of
  ``messages`` (a chat, rendered with the target's chat template; the last
  assistant message is the training target when the template allows it),
  ``prompt`` + ``completion`` (the completion is the target),
  ``text`` (every token is a target), or
  ``tokens`` + optional ``loss_start`` (pre-tokenised, as ``--regenerate``
  writes them).

Problems with single records (invalid JSON, unknown shape, too long for the
context, nothing to learn) are skipped and counted in :class:`DataReport`;
only when nothing usable is left is it an error.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DSparkError
from ..utils import write_atomic

MIN_TOKENS = 3


@dataclass
class Sequence:
    """One training sequence: token ids and which tokens are training targets."""

    tokens: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Record:
    """A prompt (already tokenised) and, unless regenerating, its answer."""

    prompt: list[int]
    answer: list[int]


@dataclass
class DataReport:
    files: int = 0
    records: int = 0
    sequences: int = 0
    tokens: int = 0
    target_tokens: int = 0
    empty_files: list[str] = field(default_factory=list)
    invalid_lines: int = 0
    unknown_records: int = 0
    too_long: int = 0
    too_short: int = 0
    examples: list[str] = field(default_factory=list)

    def skip(self, kind: str, where: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {kind.replace('_', ' ')}")

    @property
    def skipped(self) -> int:
        return (
            self.invalid_lines + self.unknown_records + self.too_long + self.too_short
        )

    def summary(self) -> str:
        parts = [
            f"{self.sequences} sequences ({self.tokens} tokens, "
            f"{self.target_tokens} training targets) from {self.files} files"
        ]
        skipped = [
            (self.invalid_lines, "invalid JSONL lines"),
            (self.unknown_records, "records without messages/prompt/text/tokens"),
            (self.too_long, "records longer than the sequence length"),
            (self.too_short, "records with nothing to learn"),
            (len(self.empty_files), "empty files"),
        ]
        skipped = [f"{n} {what}" for n, what in skipped if n]
        if skipped:
            parts.append("skipped " + ", ".join(skipped))
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "records": self.records,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "empty_files": self.empty_files,
            "invalid_lines": self.invalid_lines,
            "unknown_records": self.unknown_records,
            "too_long": self.too_long,
            "too_short": self.too_short,
        }


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_jsonl(path: Path) -> bool:
    name = path.name.lower().removesuffix(".gz")
    return name.endswith((".jsonl", ".ndjson"))


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


MAX_BINARY_SHARE = 0.01  # of a plain text file's characters; more is binary data
_TEXT_CONTROLS = set("\t\n\r\f\v")


def _binary_share(text: str) -> float:
    """Share of ``text``'s characters that text does not hold: undecodable bytes
    (read as U+FFFD) and control characters other than whitespace."""
    bad = sum(
        1
        for char in text
        if char == "\ufffd" or (char < " " and char not in _TEXT_CONTROLS)
    )
    return bad / len(text)


def _check_files(files: Iterable[str | Path]) -> list[Path]:
    paths = [Path(f).expanduser() for f in files]
    if not paths:
        raise DSparkError("No --data files were given.")
    for path in paths:
        if not path.is_file():
            raise DSparkError(f"The data file {path} does not exist.")
    return paths


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render_chat(tokenizer, messages: list, generation_prompt: bool) -> str:
    if _has_template(tokenizer):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if generation_prompt else "")


def _messages_ok(messages) -> bool:
    return (
        isinstance(messages, list)
        and len(messages) > 0
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def _record(tokenizer, obj) -> Record | None:
    """Tokenise one JSONL object; None when it has no known shape."""
    if not isinstance(obj, dict):
        return None
    if "tokens" in obj:
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        start = int(obj.get("loss_start", 0))
        return Record(tokens[:start], tokens[start:])
    if "messages" in obj:
        messages = obj["messages"]
        if not _messages_ok(messages):
            return None
        if messages[-1]["role"] == "assistant":
            prompt = _render_chat(tokenizer, messages[:-1], True)
            full = _render_chat(tokenizer, messages, False)
            if full.startswith(prompt):
                return Record(
                    _encode(tokenizer, prompt, False),
                    _encode(tokenizer, full[len(prompt) :], False),
                )
            return Record([], _encode(tokenizer, full, False))
        return Record(
            _encode(tokenizer, _render_chat(tokenizer, messages, True), False), []
        )
    if "prompt" in obj:
        prompt, completion = obj["prompt"], obj.get("completion", "")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            return None
        if _has_template(tokenizer):
            text = _render_chat(tokenizer, [{"role": "user", "content": prompt}], True)
            prompt_ids = _encode(tokenizer, text, False)
        else:
            prompt_ids = _encode(tokenizer, prompt, True)
        answer = _encode(tokenizer, completion, False) if completion else []
        if answer and tokenizer.eos_token_id is not None:
            answer.append(int(tokenizer.eos_token_id))
        return Record(prompt_ids, answer)
    if "text" in obj:
        if not isinstance(obj["text"], str):
            return None
        return Record([], _encode(tokenizer, obj["text"], True))
    return None


def iter_records(
    paths: list[Path],
    tokenizer,
    seq_len: int,
    report: DataReport,
    prompt_tokens: int = 0,
) -> Iterator[Record]:
    """Every usable record of ``paths`` in order.

    Plain text is cut into ``seq_len`` chunks; with ``prompt_tokens > 0`` each
    chunk yields only its first ``prompt_tokens`` tokens as a prompt (for
    regeneration).
    """
    for path in paths:
        report.files += 1
        if path.stat().st_size == 0:
            report.empty_files.append(str(path))
            continue
        if not _is_jsonl(path):
            try:
                with _open_text(path) as f:
                    text = f.read()
            except (OSError, EOFError) as error:
                reason = getattr(error, "strerror", None) or error
                raise DSparkError(f"Could not read {path}: {reason}.") from None
            if not text.strip():
                report.empty_files.append(str(path))
                continue
            unreadable = _binary_share(text)
            if unreadable > MAX_BINARY_SHARE:
                raise DSparkError(
                    f"{path} does not look like text ({unreadable:.0%} of it is "
                    "not UTF-8 or is control characters): give plain text or JSONL."
                )
            tokens = _encode(tokenizer, text, True)
            for begin in range(0, len(tokens), seq_len):
                chunk = tokens[begin : begin + seq_len]
                report.records += 1
                if len(chunk) < MIN_TOKENS:
                    report.skip("too_short", f"{path} (tail)")
                    continue
                if prompt_tokens:
                    yield Record(chunk[:prompt_tokens], [])
                else:
                    yield Record([], chunk)
            continue
        lines = 0
        with _open_text(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                lines += 1
                report.records += 1
                where = f"{path}:{number}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    report.skip("invalid_lines", where)
                    continue
                record = _record(tokenizer, obj)
                if record is None:
                    report.skip("unknown_records", where)
                    continue
                yield record
        if lines == 0:
            report.empty_files.append(str(path))


def load_sequences(
    files: Iterable[str | Path], tokenizer, seq_len: int
) -> tuple[list[Sequence], DataReport]:
    """Tokenised training sequences of at most ``seq_len`` tokens."""
    paths = _check_files(files)
    report = DataReport()
    sequences = []
    for record in iter_records(paths, tokenizer, seq_len, report):
        tokens = record.prompt + record.answer
        if len(tokens) > seq_len:
            report.skip("too_long", f"record {report.records}")
            continue
        mask = np.zeros(len(tokens), dtype=bool)
        mask[len(record.prompt) :] = True
        if len(tokens) < MIN_TOKENS or mask[1:].sum() == 0:
            report.skip("too_short", f"record {report.records}")
            continue
        sequences.append(Sequence(np.array(tokens, dtype=np.int32), mask))
        report.tokens += len(tokens)
        report.target_tokens += int(mask.sum())
    report.sequences = len(sequences)
    if not sequences:
        detail = f" ({'; '.join(report.examples)})" if report.examples else ""
        raise DSparkError(
            f"The data files hold no usable training sequences{detail}: "
            f"{report.summary()}."
        )
    return sequences, report


def generate_answers(
    model,
    tokenizer,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    temperature: float,
    seed: int,
) -> list[list[int]]:
    """The target's answers to ``prompts``, generated together (one batch).

    All prompts decode at once (mlx-lm's default caps a batch at 32
    sequences). An answer that stopped before ``max_tokens`` ends with the EOS
    token, so the drafter also learns where answers end. Deterministic for a
    seed and the same prompts.
    """
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    result = batch_generate(
        model,
        tokenizer,
        prompts,
        max_tokens=max_tokens,
        return_token_ids=True,
        sampler=make_sampler(temperature),
        completion_batch_size=len(prompts),
    )
    answers = []
    for answer in result.token_ids:
        answer = [int(t) for t in answer]
        if len(answer) < max_tokens and tokenizer.eos_token_id is not None:
            answer.append(int(tokenizer.eos_token_id))
        answers.append(answer)
    return answers


def _temperatures(temperature: float | Seq[float]) -> list[float]:
    if isinstance(temperature, (int, float)):
        return [float(temperature)]
    temps = [float(t) for t in temperature]
    if not temps:
        raise DSparkError("No regeneration temperature was given.")
    return temps


def regenerate(
    files: Iterable[str | Path],
    model,
    tokenizer,
    output: str | Path,
    *,
    seq_len: int,
    max_tokens: int = 256,
    prompt_tokens: int = 64,
    batch_size: int = 8,
    temperature: float | Seq[float] = 0.7,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Path, DataReport]:
    """Have the target answer every prompt of ``files``; resumable JSONL output.

    Chat records keep their prompt and get the target's answer; plain text
    contributes its chunks' first ``prompt_tokens`` tokens as prompts. With
    several temperatures every prompt is answered once at each (all prompts
    at the first, then at the next). Lines already in ``output`` (from an
    interrupted run; each batch is flushed to disk) are kept and skipped.
    """
    paths = _check_files(files)
    temps = _temperatures(temperature)
    report = DataReport()
    budget = max(seq_len - max_tokens, 1)
    prompts = []
    for record in iter_records(paths, tokenizer, seq_len, report, prompt_tokens):
        if len(record.prompt) == 0:
            record = Record(record.answer[:prompt_tokens], [])
        if not record.prompt or len(record.prompt) > budget:
            report.skip("too_long" if record.prompt else "too_short", "prompt")
            continue
        prompts.append(record.prompt)
    if not prompts:
        raise DSparkError(
            f"The data files hold no prompts to regenerate from: {report.summary()}."
        )

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    if output.exists():
        kept = []
        for line in output.read_text(encoding="utf-8").splitlines():
            try:
                kept.append(json.dumps(json.loads(line)))
            except json.JSONDecodeError:
                break
        done = len(kept)
        output.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    jobs = [
        (temp, begin) for temp in temps for begin in range(0, len(prompts), batch_size)
    ]
    total = len(prompts) * len(temps)
    with open(output, "a", encoding="utf-8") as f:
        for temp, begin in jobs:
            batch = prompts[begin : begin + batch_size]
            first = temps.index(temp) * len(prompts) + begin
            if first + len(batch) <= done:
                continue
            answers = generate_answers(
                model,
                tokenizer,
                batch,
                max_tokens=max_tokens,
                temperature=temp,
                seed=seed + begin + 1_000_003 * temps.index(temp),
            )
            skip = max(done - first, 0)
            for prompt, answer in list(zip(batch, answers, strict=True))[skip:]:
                line = {"tokens": [*prompt, *answer], "loss_start": len(prompt)}
                if len(temps) > 1:
                    line["temperature"] = temp
                f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
            if progress is not None:
                progress(first + len(batch), total)
    return output, report


def shard_name(temperature: float, index: int) -> str:
    """``t070-0012.jsonl.gz``: shard 12 (prompts ``12 * size`` on) at T=0.7."""
    return f"t{round(temperature * 100):03d}-{index:04d}.jsonl.gz"


def _write_atomic_gzip(path: Path, lines: list[str]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as raw:
            # mtime=0 and a fixed name: the same answers give the same bytes
            # (stable hashes in git).
            name = f".{path.name}.tmp"
            with gzip.GzipFile(name, mode="wb", fileobj=raw, mtime=0) as gz:
                gz.write("".join(line + "\n" for line in lines).encode("utf-8"))
            raw.flush()
            os.fsync(raw.fileno())

    write_atomic(path, write)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def regenerate_shards(
    prompts: Seq[list[int]],
    model,
    tokenizer,
    directory: str | Path,
    *,
    shard_size: int,
    temperatures: Seq[float] = (0.0, 0.7),
    max_tokens: int = 256,
    seed: int = 0,
    tags: Seq[str] | None = None,
    max_seconds: float | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[Path]:
    """The target's answers to ``prompts`` as compressed shards; resumable.

    Shard ``i`` at temperature ``t`` (:func:`shard_name`) answers prompts
    ``i * shard_size`` to ``(i + 1) * shard_size`` in one batch, one JSON line
    each (``tokens``, ``loss_start``, ``temperature`` and the prompt's ``tag``
    when given). Shards are written whole (temporary file, fsync, rename), so a
    shard that exists is complete and is skipped: rerunning continues where
    an interrupted run stopped. Shards go in order of ``i``, every temperature
    in turn, so any prefix mixes them. No shard is started once ``max_seconds``
    have passed. ``progress(done, total, tokens_per_s)`` follows every shard
    (answers done incl. existing shards, of all; generated tokens per second
    of this run). Returns every existing shard of this prompt list.
    """
    temps = _temperatures(temperatures)
    if tags is not None and len(tags) != len(prompts):
        raise DSparkError("regenerate_shards: one tag per prompt is needed.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(prompts), shard_size)
    total = len(prompts) * len(temps)
    done = sum(
        min(shard_size, len(prompts) - begin)
        for begin in starts
        for temp in temps
        if (directory / shard_name(temp, begin // shard_size)).exists()
    )
    generated, seconds, tic = 0, 0.0, time.monotonic()
    paths = []
    for begin in starts:
        index = begin // shard_size
        for t, temp in enumerate(temps):
            path = directory / shard_name(temp, index)
            if path.exists():
                paths.append(path)
                continue
            if max_seconds is not None and time.monotonic() - tic >= max_seconds:
                continue
            batch = [list(p) for p in prompts[begin : begin + shard_size]]
            start = time.perf_counter()
            answers = generate_answers(
                model,
                tokenizer,
                batch,
                max_tokens=max_tokens,
                temperature=temp,
                seed=seed + 1_000_003 * t + index,
            )
            seconds += time.perf_counter() - start
            lines = []
            for offset, (prompt, answer) in enumerate(zip(batch, answers, strict=True)):
                line = {
                    "tokens": [*prompt, *answer],
                    "loss_start": len(prompt),
                    "temperature": temp,
                }
                if tags is not None:
                    line["tag"] = tags[begin + offset]
                lines.append(json.dumps(line, separators=(",", ":")))
                generated += len(answer)
            _write_atomic_gzip(path, lines)
            paths.append(path)
            done += len(batch)
            if progress is not None:
                progress(done, total, generated / max(seconds, 1e-9))
    return paths
