"""Load a target and a drafter (DSpark, DFlash or EAGLE-3), and check that they
belong together."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .config import DraftConfig
from .copying import Drafter
from .coupled import own_keys
from .drafter import DSparkDrafter
from .eagle3_config import Eagle3Config
from .errors import DSparkError
from .lookup import PHRASES_FILE, PhraseStore
from .target import TargetAdapter


def resolve_path(path_or_repo: str | Path, what: str) -> Path:
    """A local directory, or a Hugging Face repo id found through the hub cache."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise DSparkError(f"The {what} path {path} is a file, not a model directory.")
    name = str(path_or_repo)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise DSparkError(f"The {what} {name} does not exist.")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.npy"]
    try:
        return Path(
            snapshot_download(name, allow_patterns=patterns, local_files_only=True)
        )
    except Exception:
        pass
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception:
        raise DSparkError(
            f"The {what} {name} is neither a local directory nor a reachable "
            "Hugging Face repository."
        ) from None


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DSparkError(f"{path} has no config.json.")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DSparkError(f"{config_file} is not valid JSON.") from None


def check_safetensors(file: Path) -> None:
    """Refuse a safetensors file whose header or data is cut short or garbled.

    Reads only the header: the file must be exactly as long as the header's
    last tensor says, so a truncated copy is caught before MLX reads it.
    """
    bad = DSparkError(f"{file} is truncated or not a valid safetensors file.")
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise bad
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > size - 8:
            raise bad
        try:
            header = json.loads(handle.read(header_size))
            end = max(
                (
                    v["data_offsets"][1]
                    for k, v in header.items()
                    if k != "__metadata__"
                ),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError):
            raise bad from None
    if 8 + header_size + end != size:
        raise bad


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
    from .eagle3_loading import is_eagle3

    config = read_config(resolve_path(path_or_repo, "draft model"))
    architectures = config.get("architectures") or []
    speculators = "speculators_model_type" in config or "speculators_config" in config
    dspark = any("DSpark" in str(a) for a in architectures)
    return speculators or dspark or is_eagle3(config)


def read_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of a directory's safetensors files (single or sharded)."""
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise DSparkError(f"{path} has no .safetensors weights.")
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(file))
        except Exception:
            raise DSparkError(
                f"{file} is truncated or not a valid safetensors file."
            ) from None
    return weights


def check_trained_for(
    config: DraftConfig | Eagle3Config, target: TargetAdapter, name: str = "drafter"
) -> None:
    """Refuse, in one sentence, a drafter (``name``) trained for a target of
    another hidden size, vocabulary or depth."""
    if config.hidden_size != target.hidden_size:
        raise DSparkError(
            f"The {name}'s hidden size {config.hidden_size} does not match the "
            f"target's {target.hidden_size}; it was trained for another target."
        )
    if config.vocab_size != target.vocab_size:
        raise DSparkError(
            f"The {name}'s vocabulary ({config.vocab_size}) does not match the "
            f"target's ({target.vocab_size}); it was trained for another target."
        )
    if config.num_target_layers not in (None, target.num_layers):
        raise DSparkError(
            f"The {name} was trained on a target with {config.num_target_layers} "
            f"layers, but this target has {target.num_layers}."
        )


def check_pair(config: DraftConfig, target: TargetAdapter) -> None:
    check_trained_for(config, target)
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise DSparkError(
            f"mask_token_id {config.mask_token_id} is outside the vocabulary "
            f"(size {target.vocab_size})."
        )


def _same(a: mx.array, b: mx.array) -> bool:
    return (
        a.shape == b.shape
        and mx.array_equal(a.astype(mx.float32), b.astype(mx.float32)).item()
    )


def _own_part(weights: dict[str, mx.array], module: str) -> dict[str, mx.array]:
    return {k: weights.pop(k) for k in list(weights) if k.split(".")[0] == module}


def _shareable(own: dict[str, mx.array], module: str, target_weight: mx.array) -> bool:
    """Whether a float checkpoint copy equals the target's tensor."""
    weight = own.get(f"{module}.weight")
    return (
        weight is not None
        and f"{module}.scales" not in own
        and _same(weight, target_weight)
    )


def attach_embeddings(
    drafter: nn.Module,
    config,
    weights: dict[str, mx.array],
    target: TargetAdapter | None,
    what: str,
    keep_whole: bool = True,
) -> None:
    """Give ``drafter`` its embedding and LM head: the target's where the
    checkpoint omits them or holds exact float copies, else its own (added to
    ``weights``). A reduced-vocabulary head is always the drafter's own; with
    ``keep_whole``, a complete checkpoint copy that differs anywhere is kept
    whole. ``what`` names the drafter in errors."""
    own_embed = _own_part(weights, "embed_tokens")
    own_head = _own_part(weights, "lm_head")
    share_embed = share_head = False
    if target is not None:
        share_embed = not own_embed or _shareable(
            own_embed, "embed_tokens", target.embedding.weight
        )
        share_head = not config.reduced_vocab and (
            not own_head or _shareable(own_head, "lm_head", _target_head_weight(target))
        )
        whole = keep_whole and own_embed and own_head and not config.reduced_vocab
        if whole and not (share_embed and share_head):
            share_embed = share_head = False
    if (not own_embed and not share_embed) or (not own_head and not share_head):
        if config.reduced_vocab and not own_head:
            raise DSparkError(
                f"The reduced-vocabulary {what} has no LM head of its own."
            )
        raise DSparkError(
            f"The {what} has no embedding or LM head of its own; load it with its target."
        )
    if config.is_gemma4:
        # DeepSpec's layer_scalar is a buffer of ones that a checkpoint may omit.
        for i in range(config.num_hidden_layers):
            weights.setdefault(f"layers.{i}.layer_scalar", mx.ones((1,)))
    drafter.own_embeddings(embed=not share_embed, head=not share_head)
    drafter.share_embeddings(
        target.embed if share_embed else None,
        target.lm_head if share_head else None,
    )
    if not share_embed:
        weights.update(own_embed)
    if not share_head:
        weights.update(own_head)


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


def load_checked_weights(
    module: nn.Module, weights: dict[str, mx.array], config, what: str
) -> None:
    """Quantize ``module`` as the checkpoint is (``config.quantization``), then
    load ``weights``, refusing missing, unused or misshapen tensors and a bad
    ``draft_to_target`` table in one sentence naming ``what`` was loaded."""
    if config.quantization:
        q = config.quantization
        nn.quantize(
            module,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    expected = {k for k, _ in tree_flatten(module.parameters())}
    missing = sorted(expected - set(weights))
    if missing:
        raise DSparkError(
            f"The {what} checkpoint is missing tensors: {', '.join(missing[:4])}."
        )
    unexpected = sorted(set(weights) - expected)
    if unexpected:
        raise DSparkError(
            f"The {what} checkpoint has tensors this configuration does not use: "
            f"{', '.join(unexpected[:4])}."
        )
    if config.reduced_vocab:
        weights["draft_to_target"] = _check_draft_to_target(
            weights["draft_to_target"], config
        )
    try:
        module.load_weights(list(weights.items()))
    except ValueError as error:
        raise DSparkError(
            f"The {what}'s tensor shapes do not match its config: {error}"
        ) from None


def dequantize_on_cpu(drafter: DSparkDrafter) -> None:
    """Give a quantized drafter float weights when MLX runs on the CPU.

    MLX's CPU quantized matmul is several times slower than its float one
    (a draft pass of the default drafter: about 5x), while on a GPU the
    quantized kernels are the fast ones, so there the weights stay quantized.
    """
    if mx.default_device().type == mx.cpu:
        dequantize(drafter)


def dequantize(drafter: DSparkDrafter) -> None:
    """Replace the drafter's quantized layers by float ones, in place."""
    from mlx_lm.utils import dequantize_model

    dequantize_model(drafter)


def _check_draft_to_target(table: mx.array, config: DraftConfig) -> mx.array:
    ids = np.array(table).astype(np.int64).reshape(-1)
    if ids.size != config.draft_vocab_size:
        raise DSparkError(
            f"draft_to_target has {ids.size} entries, but draft_vocab_size is "
            f"{config.draft_vocab_size}."
        )
    if (
        ids.min() < 0
        or ids.max() >= config.vocab_size
        or np.unique(ids).size != ids.size
    ):
        raise DSparkError(
            "draft_to_target must map draft ids to distinct target ids below "
            f"{config.vocab_size}."
        )
    return mx.array(ids.astype(np.int32))


def _target_head_weight(target: TargetAdapter) -> mx.array:
    return target.head.weight


def load_drafter(path_or_repo: str | Path, target: nn.Module | None = None) -> Drafter:
    """Load a DeepSpec-format (or converted MLX) drafter, optionally for
    ``target``: a DSpark (or DFlash) drafter, or an EAGLE-3 one (DeepSpec,
    speculators or MLX, :func:`~mlx_dspark.eagle3_loading.load_eagle3`)."""
    path = resolve_path(path_or_repo, "drafter")
    raw = read_config(path)
    from .eagle3_loading import is_eagle3, load_eagle3

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
    the copy proposer reads it (:func:`~mlx_dspark.copying.pair_proposer`)."""
    phrases = path / PHRASES_FILE
    drafter.phrase_store = None
    if phrases.exists():
        drafter.phrase_store = read_phrase_store(phrases, drafter.config)


def read_phrase_store(file: Path, config: DraftConfig | Eagle3Config) -> PhraseStore:
    """A drafter's :class:`~mlx_dspark.lookup.PhraseStore`, checked against
    its target vocabulary."""
    try:
        store = PhraseStore.load(file)
    except (OSError, ValueError) as error:
        raise DSparkError(f"{file} is not a phrase store: {error}.") from None
    if store.tokens.size and store.tokens.max() >= config.vocab_size:
        raise DSparkError(
            f"{file} holds token ids beyond the target vocabulary "
            f"({config.vocab_size})."
        )
    return store


def load(
    target: str | Path | None = None,
    draft_model: str | Path | None = None,
    tokenizer_config: dict | None = None,
    *,
    adapter_path: str | Path | None = None,
    model_config: dict | None = None,
    trust_remote_code: bool = False,
    pair: str | None = None,
):
    """Load ``(model, tokenizer, drafter)``; ``drafter`` is None without
    ``draft_model``, else a DSpark (or DFlash) or EAGLE-3 drafter.

    With no ``target`` this loads a built-in pair: ``pair`` names it
    (``"smollm2-135m"``, ``"gemma3-270m"``; see ``default.py`` and
    ``gemma3.py``), the default is SmolLM2-135M-Instruct and its drafter.
    ``adapter_path``, ``model_config`` and ``trust_remote_code`` apply to the
    target, as in ``mlx_lm.load``; the drafter verifies against the adapted
    target, so output stays the adapted target's own.
    """
    if pair is not None and (target is not None or draft_model is not None):
        raise DSparkError(
            "A built-in pair brings its own target and drafter; pass pair or "
            "target (and draft_model), not both."
        )
    if target is None:
        if draft_model is not None:
            raise DSparkError(
                "A draft model needs its target; pass both, or neither for the "
                "default pair."
            )
        from .default import named_pair

        target, draft_model = named_pair(pair)
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
