"""Train a DSpark drafter for an mlx-lm target: ``mlx_dspark.train``.

Method (DeepSpec / paper section 3.3): the frozen target runs once over each
sequence and yields the tapped context features and its own next-token
distributions (:mod:`mlx_dspark.training.teacher`). Anchors are sampled per
sequence; each block ``[anchor, mask, ...]`` sits at positions ``anchor ..``
and attends, bidirectionally within the block, to the projected features of
the tokens strictly before the anchor (:mod:`mlx_dspark.training.model`).
Block position ``k`` predicts token ``anchor + k + 1``; the loss is in
:mod:`mlx_dspark.training.loss`, the loop in :mod:`mlx_dspark.training.trainer`.
A Gemma-4 target gets DeepSpec's ``Gemma4DSparkModel`` drafter
(:func:`mlx_dspark.training.model.gemma4_config`); the rest is the same.
``kind="eagle3"`` trains DeepSpec's EAGLE-3 drafter instead
(:mod:`mlx_dspark.training.eagle3`), from the same teacher store, data,
checkpoints and export. DFlash is the DSpark model without its sequential
and confidence heads (``markov_head="none"``, ``confidence=False``).
This module holds the arguments and :func:`train`; the command line is in
:mod:`mlx_dspark.cli.train`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from ..checkpoints.weights import resolve_path
from ..errors import DSparkError
from ..proposers.dspark import DSparkDrafter
from ..targets.adapter import TargetAdapter
from ..utils import cache_dir
from .batches import (
    Batch,
    DraftVocabulary,
    draft_vocabulary,
    make_batch,
    shard,
)
from .checkpoint import (
    STATE_VERSION,
    checkpoint_path,
    export_drafter,
    load_checkpoint,
    save_checkpoint,
)
from .data import Sequence, load_sequences, regenerate, sha256
from .eagle3 import (
    Eagle3Batch,
    eagle3_config,
    eagle3_loss_terms,
    make_eagle3_batch,
    new_eagle3_drafter,
)
from .model import (
    check_same_shape,
    copy_trained_weights,
    default_layer_ids,
    drafter_config,
    new_drafter,
    trained_drafter,
)
from .teacher import OnlineTeacher, TeacherStore, build_order
from .trainer import (
    METRICS,
    LoopState,
    make_step,
    make_validation,
    optimise,
    schedule,
)

logger = logging.getLogger("mlx_dspark")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# The written drafter's dtype (training keeps float32 weights either way);
# "auto": float32 on a CPU, where MLX's bfloat16 matmuls are slower, else bfloat16.
AUTO_DTYPE = "auto"
# --teacher-store's default: the user cache; "none" runs the target every step.
STORE_IN_CACHE, NO_STORE = "auto", "none"
# --draft-vocab auto: this many tokens for a target with more than twice as
# many (the default drafter's recipe), the starting drafter's with --init-from.
DEFAULT_DRAFT_VOCAB = 4096
KINDS = ("dspark", "eagle3")


@dataclass
class TrainArgs:
    model: str
    data: list[str]
    out: str
    kind: str = "dspark"
    ttt_length: int = 7
    block_size: int = 7
    layers: int = 2
    markov_head: str = "vanilla"
    markov_rank: int = 256
    draft_vocab: int | str | None = "auto"
    target_layer_ids: list[int] | None = None
    confidence: bool = True
    mask_token_id: int | None = None
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 10
    anchors: int = 64
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seq_len: int = 512
    gamma: float = 4.0
    greedy_weight: float = 0.0
    seed: int = 0
    resume: bool = False
    checkpoint_every: int = 500
    keep_checkpoint: bool = False
    teacher_store: str | None = STORE_IN_CACHE
    refresh_teacher_store: bool = False
    init_from_target: bool = False
    init_from: str | None = None
    regenerate: bool = False
    regenerate_out: str | None = None
    regen_max_tokens: int = 256
    regen_prompt_tokens: int = 64
    regen_temperature: float = 0.7
    regen_batch_size: int = 8
    with_embeddings: bool = False
    dtype: str = AUTO_DTYPE
    quantize_bits: int | None = None
    quantize_group_size: int = 64
    force: bool = False
    log_every: int = 10
    val_sequences: int = 0
    val_data: list[str] | None = None
    val_every: int = 50
    quiet: bool = False


@dataclass
class TrainResult:
    status: str
    out: Path | None
    checkpoint: Path
    step: int
    metrics: dict = field(default_factory=dict)
    history: list = field(default_factory=list)


Progress = Callable[[str, int, int, str], None]


def train(
    args: TrainArgs,
    should_stop: Callable[[int], bool] | None = None,
    progress: Progress | None = None,
) -> TrainResult:
    """Train a drafter; ``should_stop(step)`` can request a clean stop (tests).

    ``progress(stage, done, total, metrics)`` follows the stages
    ("regenerating", "teacher store", "training"); the CLI draws it.
    Started by ``mlx.launch`` with several processes, it trains data-parallel
    (:func:`~mlx_dspark.training.batches.shard`): rank 0 reports, validates,
    checkpoints and exports, and builds the teacher store before the others
    open it.
    """
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    if rank > 0:
        args, progress = replace(args, quiet=True), None
    stage = _stage_progress(progress)
    _check_args(args)
    args = replace(args, dtype=resolved_dtype(args.dtype))
    if size > 1 and args.regenerate:
        raise DSparkError("Regenerate in one process (--regenerate), then train.")
    if size > args.batch_size:
        raise DSparkError(
            f"--batch-size {args.batch_size} is smaller than the {size} processes."
        )
    out = Path(args.out).expanduser()
    ckpt = checkpoint_path(out)
    target_path, target_config, model, tokenizer = _load_target(args.model)
    layer_ids = args.target_layer_ids or default_layer_ids(len(model.layers))
    target = TargetAdapter(model, layer_ids)
    mask_token_id = _mask_token_id(args, target)
    start = _start_drafter(args, model)
    inputs = [
        {"path": str(p), "sha256": sha256(p)} for p in args.data if Path(p).is_file()
    ]
    data_files = (
        _regenerated(args, out, model, tokenizer, stage("regenerating"))
        if args.regenerate
        else args.data
    )
    sequences, report = load_sequences(data_files, tokenizer, args.seq_len)
    _say(args, f"data: {report.summary()}")
    data_hashes = [{"path": str(p), "sha256": sha256(p)} for p in data_files]
    val_data, val_hashes = _validation_data(args, tokenizer, data_hashes)
    args = replace(args, draft_vocab=_resolved_draft_vocab(args, target, start))
    vocab = _draft_vocabulary(args, sequences, target, start)
    draft_vocab_size = None if vocab is None else len(vocab.ids)
    draft_ids = None if vocab is None else vocab.ids
    if args.kind == "eagle3":
        config = eagle3_config(
            target_config, target, layers=args.layers, ttt_length=args.ttt_length,
            draft_vocab_size=draft_vocab_size,
        )  # fmt: skip
        drafter = new_eagle3_drafter(config, target, args.seed, draft_ids)
    else:
        config = drafter_config(
            target_config, target, layers=args.layers, block_size=args.block_size,
            markov_head=args.markov_head, markov_rank=args.markov_rank,
            anchors=args.anchors, confidence=args.confidence,
            mask_token_id=mask_token_id, draft_vocab_size=draft_vocab_size,
        )  # fmt: skip
        if start is not None:
            check_same_shape(config, start.drafter.config, start.path)
        drafter = new_drafter(
            config, target, args.seed, draft_ids, args.init_from_target
        )
        if start is not None:
            copy_trained_weights(drafter, start.drafter, target)
    train_ids, val_ids = _split(len(sequences), args.val_sequences, args.seed)
    per_epoch = math.ceil(len(train_ids) / args.batch_size)
    total = args.steps or max(1, math.ceil((args.epochs or 1.0) * per_epoch))
    optimizer = optim.AdamW(
        learning_rate=schedule(args.lr, total, int(args.warmup * total)),
        weight_decay=args.weight_decay,
    )
    identity = {
        "version": STATE_VERSION, "config": config.to_dict(), "data": data_hashes,
        "seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "gamma": args.gamma, "lr": args.lr, "total_steps": total,
        "init_from_target": args.init_from_target,
        "init_from": None if start is None else start.weights_sha256,
        "val_sequences": args.val_sequences, "val_data": val_hashes,
    }  # fmt: skip
    if args.greedy_weight:  # checkpoints from before the flag still resume
        identity["greedy_weight"] = args.greedy_weight
    if args.kind != "dspark":
        identity.update(kind=args.kind, ttt_length=args.ttt_length)
    state = (
        _resume(args, ckpt, drafter, optimizer, identity)
        if args.resume
        else LoopState()
    )
    if size > 1:
        _say(args, f"data parallel over {size} processes")
    if rank > 0:  # rank 0 builds the store
        _all_sum(0, group)
    teacher = _teacher(
        args, target, target_path, sequences, data_hashes, draft_ids,
        stage("teacher store"), refresh=args.refresh_teacher_store and rank == 0,
    )  # fmt: skip
    if rank == 0 and size > 1:
        _all_sum(0, group)

    def save(state: LoopState) -> None:
        if rank == 0:
            save_checkpoint(ckpt, drafter, optimizer, _snapshot(identity, state))

    batch_maker = _make_eagle3_batch if args.kind == "eagle3" else _make_batch
    make = partial(batch_maker, args, sequences, mask_token_id, vocab)
    next_batch = _batches(args, train_ids, per_epoch, make, rank, size)
    val_teacher, val_make = teacher, make
    if val_data and rank == 0:  # held-out files instead of a split
        val_teacher = _teacher(
            args, target, target_path, val_data, val_hashes, draft_ids,
            stage("validation store"), refresh=args.refresh_teacher_store,
        )  # fmt: skip
        val_make = partial(batch_maker, args, val_data, mask_token_id, vocab)
        val_ids = list(range(len(val_data)))
    val_batches = _validation_batches(args, val_ids, val_make) if rank == 0 else []
    loss, batch_type = (
        (eagle3_loss_terms, Eagle3Batch) if args.kind == "eagle3" else (None, Batch)
    )
    validate = (
        make_validation(drafter, val_teacher, val_batches, args.greedy_weight, loss)
        if val_batches
        else None
    )
    parallel = group if size > 1 else None
    status, final = optimise(
        make_step(drafter, optimizer, args.grad_clip, group=parallel,
                  greedy_weight=args.greedy_weight, loss=loss,
                  batch_type=batch_type), next_batch,
        teacher, state, total, log_every=args.log_every,
        checkpoint_every=args.checkpoint_every, save=save, should_stop=should_stop,
        progress=stage("training"), validate=validate, validate_every=args.val_every,
        agree=None if parallel is None else lambda stop: _all_sum(stop, group) > 0,
    )  # fmt: skip
    save(state)
    if status == "interrupted":
        logger.warning(
            "stopped at step %d/%d; checkpoint saved to %s; rerun with --resume "
            "to continue",
            state.step,
            total,
            ckpt,
        )
        return TrainResult(status, None, ckpt, state.step, final, state.history)
    if rank > 0:
        return TrainResult(status, None, ckpt, state.step, final, state.history)
    record = _record(args, target_path, layer_ids, mask_token_id, inputs, data_hashes,
                     report, vocab, state, per_epoch, final, size, start,
                     val_hashes)  # fmt: skip
    if out.exists() and args.force:
        shutil.rmtree(out)
    quantize = (
        (args.quantize_bits, args.quantize_group_size) if args.quantize_bits else None
    )
    export_drafter(
        out, drafter, target, record, args.with_embeddings, DTYPES[args.dtype], quantize
    )
    if not args.keep_checkpoint:
        shutil.rmtree(ckpt, ignore_errors=True)
    _say(args, f"wrote {out} ({', '.join(f'{n} {v:.3f}' for n, v in final.items())}, "
         f"{state.positions_per_s:.0f} block positions/s)")  # fmt: skip
    return TrainResult(status, out, ckpt, state.step, final, state.history)


# ------------------------------------------------------------------ the pieces


def _check_args(args: TrainArgs) -> None:
    if args.kind not in KINDS:
        raise DSparkError(f"--kind must be dspark or eagle3, got {args.kind!r}.")
    if args.kind == "eagle3":
        _check_eagle3_args(args)
    if args.markov_head not in ("vanilla", "gated", "rnn", "none"):
        raise DSparkError(
            f"--markov-head must be vanilla, gated, rnn or none, got {args.markov_head!r}."
        )
    positive = {
        "--block-size": args.block_size,
        "--layers": args.layers,
        "--batch-size": args.batch_size,
        "--anchors": args.anchors,
        "--seq-len": args.seq_len,
    }
    if isinstance(args.draft_vocab, int):
        positive["--draft-vocab"] = args.draft_vocab
    elif args.draft_vocab not in (None, "auto", "none"):
        raise DSparkError(
            f"--draft-vocab must be a number, auto or none, got {args.draft_vocab!r}."
        )
    if args.markov_head != "none":
        positive["--markov-rank"] = args.markov_rank
    positive.update(
        {
            "--checkpoint-every": args.checkpoint_every,
            "--log-every": args.log_every,
            "--val-every": args.val_every,
            "--regen-max-tokens": args.regen_max_tokens,
            "--regen-prompt-tokens": args.regen_prompt_tokens,
            "--regen-batch-size": args.regen_batch_size,
        }
    )
    for flag, value in positive.items():
        if value < 1:
            raise DSparkError(f"{flag} must be at least 1, got {value}.")
    at_least_zero = {
        "--regen-temperature": args.regen_temperature,
        "--weight-decay": args.weight_decay,
        "--grad-clip": args.grad_clip,
        "--gamma": args.gamma,
        "--greedy-weight": args.greedy_weight,
    }
    for flag, value in at_least_zero.items():
        if not value >= 0:
            raise DSparkError(f"{flag} must be >= 0, got {value}.")
    if args.val_sequences < 0:
        raise DSparkError(f"--val-sequences must be >= 0, got {args.val_sequences}.")
    if args.val_data and args.val_sequences:
        raise DSparkError("Give either --val-data or --val-sequences, not both.")
    if not 0 <= args.warmup < 1:
        raise DSparkError(f"--warmup must be a fraction in [0, 1), got {args.warmup}.")
    if args.quantize_group_size not in (32, 64, 128):
        raise DSparkError(
            f"--quantize-group-size must be 32, 64 or 128, got {args.quantize_group_size}."
        )
    if args.steps is not None and args.epochs is not None:
        raise DSparkError("Give either --steps or --epochs, not both.")
    if args.steps is not None and args.steps < 1:
        raise DSparkError(f"--steps must be at least 1, got {args.steps}.")
    if args.epochs is not None and args.epochs <= 0:
        raise DSparkError(f"--epochs must be positive, got {args.epochs}.")
    if args.lr <= 0:
        raise DSparkError(f"--lr must be positive, got {args.lr}.")
    if args.dtype not in (AUTO_DTYPE, *DTYPES):
        raise DSparkError(
            f"--dtype must be auto or one of {', '.join(DTYPES)}, got {args.dtype!r}."
        )
    if args.refresh_teacher_store and teacher_store_dir(args) is None:
        raise DSparkError("--refresh-teacher-store needs a teacher store, not none.")
    out = Path(args.out).expanduser()
    ckpt = checkpoint_path(out)
    if out.exists() and not args.force:
        raise DSparkError(
            f"The output directory {out} already exists; pass --force to replace it."
        )
    if ckpt.exists() and not args.resume and not args.force:
        raise DSparkError(
            f"A training checkpoint exists at {ckpt}; pass --resume to continue it "
            "or --force to start over."
        )
    if args.init_from and args.init_from_target:
        raise DSparkError("Give either --init-from or --init-from-target, not both.")
    if args.resume and not ckpt.exists():
        raise DSparkError(f"--resume found no checkpoint at {ckpt}.")


def _check_eagle3_args(args: TrainArgs) -> None:
    """What does not apply to an EAGLE-3 drafter is refused, not ignored."""
    if args.ttt_length < 1:
        raise DSparkError(f"--ttt-length must be at least 1, got {args.ttt_length}.")
    given = {
        "--init-from": args.init_from,
        "--init-from-target": args.init_from_target,
        "--greedy-weight": args.greedy_weight,
    }
    for flag, value in given.items():
        if value:
            raise DSparkError(f"{flag} is for DSpark drafters, not --kind eagle3.")
    if mx.distributed.init().size() > 1:
        raise DSparkError("--kind eagle3 trains in one process only.")


def _load_target(path: str):
    from ..checkpoints.loading import load_target

    target_path, config, model, tokenizer = load_target(path)
    model.freeze()
    return target_path, config, model, tokenizer


def _mask_token_id(args: TrainArgs, target: TargetAdapter) -> int:
    mask = target.vocab_size - 1 if args.mask_token_id is None else args.mask_token_id
    if not 0 <= mask < target.vocab_size:
        raise DSparkError(
            f"--mask-token-id {mask} is outside the vocabulary (size {target.vocab_size})."
        )
    return mask


def _stage_progress(progress: Progress | None):
    """Per stage, the library's ``progress(done, total[, metrics])`` callback."""

    def stage(name: str):
        if progress is None:
            return None
        return lambda done, total, metrics="": progress(name, done, total, metrics)

    return stage


def _regenerated(args: TrainArgs, out: Path, model, tokenizer, progress) -> list[str]:
    regen_out = Path(args.regenerate_out or str(out) + ".regenerated.jsonl")
    path, _ = regenerate(
        list(args.data), model, tokenizer, regen_out, seq_len=args.seq_len,
        max_tokens=args.regen_max_tokens, prompt_tokens=args.regen_prompt_tokens,
        batch_size=args.regen_batch_size, temperature=args.regen_temperature,
        seed=args.seed, progress=progress,
    )  # fmt: skip
    _say(args, f"regenerated responses in {path}")
    return [str(path)]


def _resolved_draft_vocab(
    args: TrainArgs, target: TargetAdapter, start: StartDrafter | None
) -> int | None:
    """``--draft-vocab`` as a size (None: the whole vocabulary); ``auto`` is
    the starting drafter's with ``--init-from``, else DEFAULT_DRAFT_VOCAB for
    a target with more than twice as many tokens."""
    if args.draft_vocab != "auto":
        return None if args.draft_vocab == "none" else args.draft_vocab
    if start is not None:
        drafter = start.drafter
        return drafter.config.draft_vocab_size if drafter.config.reduced_vocab else None
    return DEFAULT_DRAFT_VOCAB if target.vocab_size > 2 * DEFAULT_DRAFT_VOCAB else None


def _draft_vocabulary(
    args: TrainArgs, sequences, target, start: StartDrafter | None
) -> DraftVocabulary | None:
    """The most frequent training labels, or the starting drafter's own
    vocabulary (its head rows must keep meaning the same tokens)."""
    if args.draft_vocab is None:
        return None
    if args.draft_vocab >= target.vocab_size:
        raise DSparkError(
            f"--draft-vocab {args.draft_vocab} must be smaller than the target's "
            f"vocabulary ({target.vocab_size})."
        )
    ids = None
    if start is not None and start.drafter.config.reduced_vocab:
        ids = np.asarray(start.drafter.draft_to_target).astype(np.int32)
    vocab = draft_vocabulary(sequences, args.draft_vocab, target.vocab_size, ids)
    _say(
        args,
        f"draft vocabulary: {len(vocab.ids)} tokens, "
        f"{vocab.coverage:.1%} of the training labels",
    )
    return vocab


@dataclass
class StartDrafter:
    """The drafter a run starts from (``--init-from``) and its history."""

    path: Path
    drafter: DSparkDrafter
    weights_sha256: str
    runs: list[dict]


def _start_drafter(args: TrainArgs, target_model) -> StartDrafter | None:
    if not args.init_from:
        return None
    path = resolve_path(args.init_from, "--init-from drafter")
    drafter = trained_drafter(path, target_model)
    try:
        record = json.loads((path / "training_record.json").read_text())
    except (OSError, json.JSONDecodeError):
        record = {}
    runs = record.get("runs") or ([_run_summary(record)] if "steps" in record else [])
    weights = sorted(path.glob("*.safetensors"))
    digest = hashlib.sha256("".join(sha256(w) for w in weights).encode()).hexdigest()
    _say(args, f"starting from {path} ({sum(r['steps'] for r in runs)} steps before)")
    return StartDrafter(path, drafter, digest, runs)


def _run_summary(record: dict) -> dict:
    """One training run as the record of a later run keeps it."""
    return {
        "steps": record["steps"],
        "train_time_s": record.get("train_time_s", 0.0),
        "block_positions": record.get("block_positions", 0),
        "data": record.get("data", []),
        "init_from": record.get("init_from"),
    }


def resolved_dtype(dtype: str) -> str:
    """``--dtype``, with ``auto`` resolved by the default device: float32 on
    a CPU, bfloat16 on a GPU."""
    if dtype != AUTO_DTYPE:
        return dtype
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def teacher_store_dir(args: TrainArgs) -> Path | None:
    """Where ``--teacher-store`` keeps its stores: ``auto`` is the user cache
    (``cache_dir() / "teacher"``), ``none`` (or None) keeps none."""
    if args.teacher_store is None or args.teacher_store == NO_STORE:
        return None
    if args.teacher_store == STORE_IN_CACHE:
        return cache_dir() / "teacher"
    return Path(args.teacher_store).expanduser()


def target_fingerprint(path: Path) -> list:
    """What identifies the target at ``path``: its small files (config,
    tokenizer) by content, its weights by name, size and modification time
    (hashing gigabytes at every run would cost more than it saves)."""
    entries = []
    for file in sorted(p for p in Path(path).iterdir() if p.is_file()):
        stat = file.stat()
        if stat.st_size <= FINGERPRINT_BYTES:
            entries.append([file.name, sha256(file)])
        else:
            entries.append([file.name, stat.st_size, stat.st_mtime_ns])
    return entries


FINGERPRINT_BYTES = 2**25


def _teacher(
    args, target, target_path, sequences, data_hashes, draft_ids, progress,
    refresh=False,
):  # fmt: skip
    """The teacher store under ``--teacher-store`` (the user cache by
    default), built on first use and reused while the target, the data's
    contents and the settings that shape it are the same; ``refresh``
    rebuilds it. With ``--teacher-store none``, the target on the fly."""
    root = teacher_store_dir(args)
    if root is None:
        return OnlineTeacher(target, draft_ids)
    ids = None if draft_ids is None else draft_ids.tolist()
    contents = [h["sha256"] for h in data_hashes]  # not paths: data may move
    key = hashlib.sha256(
        json.dumps(
            [
                str(target_path), target_fingerprint(target_path), target.layer_ids,
                contents, args.seq_len, ids,
            ]
        ).encode()
    ).hexdigest()  # fmt: skip
    directory = root / key[:16]
    if refresh:
        shutil.rmtree(directory, ignore_errors=True)
    elif TeacherStore.complete(directory, key):
        store = TeacherStore(directory)
        _say(
            args, f"teacher store: reusing {directory} ({store.nbytes / 2**20:.0f} MiB)"
        )
        return store
    # A batch's logits are sequences x tokens x vocabulary floats, held twice
    # (MLX, NumPy): about 1 GiB each at most (8 sequences of 512 tokens at
    # SmolLM2's 49k vocabulary, 3 of 320 at Gemma-3's 262k).
    batch = max(1, min(8, TEACHER_LOGITS // (args.seq_len * target.vocab_size)))
    tic = time.perf_counter()
    store = TeacherStore.build(
        directory, key, target, sequences, draft_ids, batch_size=batch,
        progress=_build_rate(progress, sequences, tic),
    )  # fmt: skip
    seconds = time.perf_counter() - tic
    tokens = sum(len(s) for s in sequences)
    _say(
        args,
        f"teacher store: built {directory} ({store.nbytes / 2**20:.0f} MiB) in "
        f"{seconds:.0f} s, {tokens / max(seconds, 1e-9):.0f} tokens/s",
    )
    return store


def _build_rate(progress, sequences: list[Sequence], tic: float):
    """``progress(done, total)`` of a store's build, with its rate in tokens
    per second as the metrics."""
    if progress is None:
        return None
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    done_tokens = np.cumsum(lengths[build_order(lengths)])

    def report(done: int, total: int) -> None:
        seconds = max(time.perf_counter() - tic, 1e-9)
        tokens = int(done_tokens[done - 1]) if done else 0
        progress(done, total, f"{tokens / seconds:.0f} tokens/s")

    return report


TEACHER_LOGITS = 2**28
SHAPE_STEP = 64  # batches are padded to a multiple: few shapes to compile


def _validation_data(
    args: TrainArgs, tokenizer, data_hashes: list[dict]
) -> tuple[list[Sequence], list[dict]]:
    """The ``--val-data`` sequences and their files' hashes (none: empty)."""
    if not args.val_data:
        return [], []
    hashes = [{"path": str(p), "sha256": sha256(p)} for p in args.val_data]
    training = {h["sha256"] for h in data_hashes}
    for h in hashes:
        if h["sha256"] in training:
            raise DSparkError(f"--val-data {h['path']} is also training data.")
    sequences, report = load_sequences(args.val_data, tokenizer, args.seq_len)
    _say(args, f"validation data: {report.summary()}")
    return sequences, hashes


def _split(count: int, val_sequences: int, seed: int) -> tuple[list[int], list[int]]:
    """Training and validation sequence indices: ``val_sequences`` chosen by
    the seed, held out of every training batch."""
    if val_sequences >= count:
        raise DSparkError(
            f"--val-sequences {val_sequences} leaves no training data "
            f"({count} sequences)."
        )
    held = set(
        np.random.default_rng([seed, 2]).permutation(count)[:val_sequences].tolist()
    )
    return [i for i in range(count) if i not in held], sorted(held)


def _make_batch(args, sequences, mask_token_id, vocab, indices, rng) -> Batch:
    longest = max(len(sequences[i]) for i in indices)
    return make_batch(
        [sequences[i] for i in indices], args.anchors, args.block_size,
        mask_token_id, args.gamma, rng,
        None if vocab is None else vocab.target_to_draft,
        length=-(-longest // SHAPE_STEP) * SHAPE_STEP,
    )  # fmt: skip


def _make_eagle3_batch(args, sequences, mask_token_id, vocab, indices, rng):
    """A batch of whole sequences (``rng``, ``mask_token_id`` and ``vocab``
    are DSpark's: every position trains, with the target's own rows)."""
    longest = max(len(sequences[i]) for i in indices)
    return make_eagle3_batch(
        [sequences[i] for i in indices], args.ttt_length,
        length=-(-longest // SHAPE_STEP) * SHAPE_STEP,
    )  # fmt: skip


def _batches(
    args: TrainArgs,
    train_ids: list[int],
    per_epoch: int,
    make: Callable[[list[int], np.random.Generator], Batch],
    rank: int = 0,
    size: int = 1,
) -> Callable[[int], tuple[list[int], Batch]]:
    """Step -> (sequence indices, batch): epochs in a seeded order, anchors
    seeded by the step, so that a resumed run sees the same batches. With
    ``size`` processes, rank ``rank``'s share of them."""

    def next_batch(step: int) -> tuple[list[int], Batch]:
        epoch, position = divmod(step, per_epoch)
        order = np.random.default_rng([args.seed, epoch]).permutation(train_ids)
        chunk = order[position * args.batch_size : (position + 1) * args.batch_size]
        indices = [int(i) for i in chunk]
        batch = make(indices, np.random.default_rng([args.seed, 1, step]))
        if size == 1:
            return indices, batch
        return indices[rank::size], shard(batch, rank, size)

    return next_batch


def _validation_batches(
    args: TrainArgs,
    val_ids: list[int],
    make: Callable[[list[int], np.random.Generator], Batch],
) -> list[tuple[list[int], Batch]]:
    """The validation sequences in batches, their anchors fixed once."""
    chunks = [
        val_ids[i : i + args.batch_size]
        for i in range(0, len(val_ids), args.batch_size)
    ]
    return [
        (chunk, make(chunk, np.random.default_rng([args.seed, 3, n])))
        for n, chunk in enumerate(chunks)
    ]


def _all_sum(value: int, group: mx.distributed.Group) -> int:
    """The sum over the processes of ``value``; waits for all of them."""
    total = mx.distributed.all_sum(mx.array(int(value)), group=group, stream=mx.cpu)
    return int(total.item())


def _record(
    args, target_path, layer_ids, mask_token_id, inputs, data_hashes, report,
    vocab, state: LoopState, per_epoch: int, final: dict, processes: int,
    start: StartDrafter | None, val_hashes: list[dict],
) -> dict:  # fmt: skip
    """``training_record.json``: arguments, data, throughput, metrics, and
    every run from the first one (``--init-from`` chains them)."""
    init_from = None if start is None else {
        "path": str(start.path), "weights_sha256": start.weights_sha256,
    }  # fmt: skip
    this_run = {
        "steps": state.step, "train_time_s": state.train_time_s,
        "block_positions": state.block_positions, "data": data_hashes,
        "init_from": init_from,
    }  # fmt: skip
    runs = ([] if start is None else start.runs) + [this_run]
    return {
        "format": "mlx-dspark training record v2", "arguments": asdict(args),
        "target": str(target_path), "target_layer_ids": layer_ids,
        "mask_token_id": mask_token_id, "inputs": inputs, "data": data_hashes,
        "data_report": report.to_dict(),
        "draft_vocab_label_coverage": None if vocab is None else vocab.coverage,
        "steps": state.step, "steps_per_epoch": per_epoch, "processes": processes,
        "train_time_s": state.train_time_s, "block_positions": state.block_positions,
        "block_positions_per_s": state.positions_per_s, "final_metrics": final,
        "history_columns": ["step", *METRICS], "history": state.history,
        "validation_columns": ["step", "train_time_s", *METRICS],
        "validation": state.validation,
        "validation_data": val_hashes,
        "init_from": init_from, "runs": runs,
        "total_steps": sum(r["steps"] for r in runs),
        "total_train_time_s": sum(r["train_time_s"] for r in runs),
        "total_block_positions": sum(r["block_positions"] for r in runs),
        "versions": {"mlx": mx.__version__, "mlx_lm": _mlx_lm_version()},
    }  # fmt: skip


def _by_content(value):
    """An identity entry with file paths left out: data files are the same
    data wherever they now lie, as their sha256 says."""
    if isinstance(value, list):
        return [_by_content(v) for v in value]
    if isinstance(value, dict):
        return {k: _by_content(v) for k, v in value.items() if k != "path"}
    return value


def _resume(args, ckpt: Path, drafter, optimizer, identity: dict) -> LoopState:
    state = load_checkpoint(ckpt, drafter, optimizer)
    saved = state.get("identity", {})
    changed = [
        k for k, v in identity.items() if _by_content(saved.get(k)) != _by_content(v)
    ]
    if changed:
        raise DSparkError(
            f"--resume needs the same settings and data as the checkpoint; "
            f"these differ: {', '.join(changed)}."
        )
    _say(args, f"resumed from {ckpt} at step {state['step']}")
    return LoopState(
        state["step"],
        state.get("history", []),
        state.get("block_positions", 0),
        state.get("train_time_s", 0.0),
        state.get("validation", []),
    )


def _snapshot(identity: dict, state: LoopState) -> dict:
    return {
        "identity": identity,
        "step": state.step,
        "history": state.history,
        "block_positions": state.block_positions,
        "train_time_s": state.train_time_s,
        "validation": state.validation,
        "rng": {"numpy": "seeded by (seed, epoch) for order, (seed, step) for anchors"},
    }


def _mlx_lm_version() -> str:
    try:
        from mlx_lm import __version__

        return __version__
    except ImportError:
        return "unknown"


def _say(args: TrainArgs, message: str) -> None:
    if not args.quiet:
        logger.info(message)
