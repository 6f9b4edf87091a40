"""Load a target and a drafter (DSpark, DFlash or EAGLE-3), and check that they
belong together."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import DSparkError
from ..proposers.copying import Drafter
from ..proposers.dspark import DSparkDrafter
from ..proposers.dspark_config import DraftConfig
from ..proposers.eagle3_config import Eagle3Config
from ..proposers.suffix_store import PHRASES_FILE, SuffixStore, phrase_store
from ..sampling.coupled import own_keys
from ..targets.adapter import TargetAdapter
from .weights import (
    attach_embeddings,
    check_safetensors,
    check_trained_for,
    dequantize_on_cpu,
    load_checked_weights,
    read_config,
    read_weights,
    resolve_path,
)


def check_json_files(path: Path, names: tuple[str, ...]) -> None:
    for name in names:
        file = path / name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DSparkError(f"{file} is not valid JSON.") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_target(
    path_or_repo: str | Path,
    tokenizer_config: dict | None = None,
    *,
    adapter_path: str | Path | None = None,
    model_config: dict | None = None,
    trust_remote_code: bool = False,
) -> tuple[Path, dict, nn.Module, object]:
    """Load an mlx-lm target: ``(path, config, model, tokenizer)``.

    ``adapter_path`` (LoRA/DoRA adapters), ``model_config`` and
    ``trust_remote_code`` are passed to ``mlx_lm.utils.load`` as is. A broken
    directory (missing or garbled config, tokenizer or weights, weights that
    do not fit the config) is refused with one sentence naming what is wrong,
    never with mlx-lm's own traceback.
    """
    from mlx_lm.utils import load as mlx_lm_load

    path = resolve_path(path_or_repo, "model")
    config = read_config(path)
    weight_files = sorted(path.glob("model*.safetensors"))
    if not weight_files:
        raise DSparkError(
            f"{path} has no model.safetensors weights (model*.safetensors)."
        )
    for file in weight_files:
        check_safetensors(file)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise DSparkError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}).")
    check_json_files(path, ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    if adapter_path is not None:
        check_adapter(Path(adapter_path).expanduser())
    try:
        model, tokenizer = mlx_lm_load(
            str(path),
            tokenizer_config=tokenizer_config,
            model_config=model_config,
            adapter_path=None if adapter_path is None else str(adapter_path),
            trust_remote_code=trust_remote_code,
        )
    except Exception as error:
        reason = str(error).strip().splitlines()[0].rstrip(".") or type(error).__name__
        if isinstance(error, ValueError) and "parameter" in reason:
            raise DSparkError(
                f"The weights in {path} do not fit its config.json ({reason})."
            ) from None
        raise DSparkError(f"Could not load the model at {path} ({reason}).") from None
    return path, config, model, tokenizer


def check_adapter(path: Path) -> None:
    """Refuse an adapter directory mlx-lm could not load, in one sentence."""
    if not path.is_dir():
        raise DSparkError(f"The adapter path {path} is not a directory.")
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (path / name).is_file():
            raise DSparkError(f"The adapter path {path} has no {name}.")
    check_json_files(path, ("adapter_config.json",))
    check_safetensors(path / "adapters.safetensors")


def is_dspark_drafter(path_or_repo: str | Path) -> bool:
    """Whether a draft model is one this package's loop runs (a DSpark, DFlash
    or EAGLE-3 drafter, by its config), rather than an ordinary mlx-lm model
    for mlx-lm's own speculative decoding."""
    from ..proposers.gemma4_assistant_config import is_assistant
    from .eagle3 import is_eagle3
    from .mtp import is_mtp

    config = read_config(resolve_path(path_or_repo, "draft model"))
    if is_assistant(config):
        return True
    architectures = config.get("architectures") or []
    speculators = "speculators_model_type" in config or "speculators_config" in config
    dspark = any("DSpark" in str(a) for a in architectures)
    return speculators or dspark or is_eagle3(config) or is_mtp(config)


def check_pair(config: DraftConfig, target: TargetAdapter) -> None:
    check_trained_for(config, target)
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise DSparkError(
            f"mask_token_id {config.mask_token_id} is outside the vocabulary "
            f"(size {target.vocab_size})."
        )


def build_drafter(
    config: DraftConfig, weights: dict[str, mx.array], target: TargetAdapter | None
) -> DSparkDrafter:
    """Instantiate the drafter, sharing the target's embedding and head when
    possible (:func:`attach_embeddings`)."""
    drafter = DSparkDrafter(config)
    attach_embeddings(drafter, config, weights, target, "drafter")
    load_checked_weights(drafter, weights, config, "drafter")
    dequantize_on_cpu(drafter)
    mx.eval(drafter.parameters())
    if drafter.markov_head is not None:
        drafter.compile_greedy_chain()
    return drafter


def load_drafter(path_or_repo: str | Path, target: nn.Module | None = None) -> Drafter:
    """Load a DeepSpec-format (or converted MLX) drafter, optionally for
    ``target``: a DSpark (or DFlash) drafter, or an EAGLE-3 one (DeepSpec,
    speculators or MLX, :func:`~mlx_dspark.checkpoints.eagle3.load_eagle3`), or
    an MTP module (:func:`~mlx_dspark.checkpoints.mtp.load_mtp`)."""
    path = resolve_path(path_or_repo, "drafter")
    raw = read_config(path)
    from ..proposers.gemma4_assistant_config import is_assistant
    from .eagle3 import is_eagle3, load_eagle3
    from .gemma4_assistant import load_assistant
    from .mtp import is_mtp, load_mtp

    if is_assistant(raw):
        return load_assistant(path, target)
    if is_mtp(raw):
        drafter = load_mtp(path, target)
        drafter.phrase_store = None
        return drafter
    if is_eagle3(raw):
        drafter = load_eagle3(path, target)
        attach_phrase_store(drafter, path)
        return drafter
    if "speculators_model_type" in raw or "speculators_config" in raw:
        raise DSparkError(
            f"{path} is a vLLM speculators checkpoint; convert it first with "
            f"mlx_dspark.convert --draft-model {path_or_repo} --out DIR."
        )
    config = DraftConfig.from_dict(raw)
    adapter = None
    if target is not None:
        adapter = TargetAdapter(target, config.target_layer_ids)
        check_pair(config, adapter)
    drafter = build_drafter(config, read_weights(path), adapter)
    drafter.source_path = path
    attach_phrase_store(drafter, path)
    return drafter


def attach_phrase_store(drafter: Drafter, path: Path) -> None:
    """The pair's phrase store rides with the drafter it was written beside;
    the copy proposer reads it (:func:`~mlx_dspark.proposers.copying.pair_proposer`)."""
    phrases = path / PHRASES_FILE
    drafter.phrase_store = None
    if phrases.exists():
        drafter.phrase_store = read_phrase_store(phrases, drafter.config)


def read_phrase_store(file: Path, config: DraftConfig | Eagle3Config) -> SuffixStore:
    """A drafter's phrase store as a pre-filled global
    :class:`~mlx_dspark.proposers.suffix_store.SuffixStore`, checked against
    its target vocabulary."""
    store = phrase_store(file)
    largest = max((int(d.max()) for d in store.documents() if d.size), default=-1)
    if largest >= config.vocab_size:
        raise DSparkError(
            f"{file} holds token ids beyond the target vocabulary "
            f"({config.vocab_size})."
        )
    return store


def load_pair(
    target: str | Path,
    draft_model: str | Path | None = None,
    tokenizer_config: dict | None = None,
    *,
    adapter_path: str | Path | None = None,
    model_config: dict | None = None,
    trust_remote_code: bool = False,
):
    """Load ``(model, tokenizer, drafter)`` from a target and, if given, a
    drafter (directories or Hugging Face repo ids): :func:`mlx_dspark.load`
    once a built-in pair's name is resolved."""
    _, _, model, tokenizer = load_target(
        target,
        tokenizer_config,
        adapter_path=adapter_path,
        model_config=model_config,
        trust_remote_code=trust_remote_code,
    )
    if draft_model is None:
        return model, tokenizer, None
    # As mlx_lm.load leaves it: the drafter's weight initialisation and the
    # self-check draw no key a seeded sampler will use.
    with own_keys():
        drafter = load_drafter(draft_model, model)
        TargetAdapter(model, drafter.config.target_layer_ids).self_check()
    return model, tokenizer, drafter
