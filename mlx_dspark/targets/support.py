"""Whether a model can be a target, read from its config alone.

``mlx_dspark doctor --model M`` answers before any weights download: it reads
``config.json`` (from a local directory, or only that file from the Hugging
Face hub), builds mlx-lm's model class without evaluating its weights (MLX
arrays are lazy, so nothing is allocated), and asks the target adapter which
caches the layers keep and whether trees can run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DSparkError
from .adapter import TargetAdapter, model_type_of, unsupported_reason


@dataclass
class Support:
    model: str
    model_type: str | None
    supported: bool
    reason: str | None = None
    rollback: list[str] = field(default_factory=list)
    tree: bool = False
    quantization: dict | None = None


def read_model_config(name: str) -> dict:
    """A model's ``config.json``: from a local directory, or that one file
    from the hub (the hub cache first)."""
    path = Path(name).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise DSparkError(f"{path} has no config.json.")
    elif name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise DSparkError(f"The model {name} does not exist.")
    else:
        config_file = _hub_config(name)
    try:
        return json.loads(Path(config_file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DSparkError(f"{config_file} is not valid JSON.") from None


def _hub_config(repo: str) -> str:
    from huggingface_hub import hf_hub_download

    for local_only in (True, False):
        try:
            return hf_hub_download(repo, "config.json", local_files_only=local_only)
        except Exception:
            continue
    raise DSparkError(
        f"The model {repo} is neither a local directory nor a reachable Hugging "
        "Face repository."
    )


def target_support(name: str) -> Support:
    """What the adapter would do with this model as a target."""
    from mlx_lm.utils import _get_classes

    config = read_model_config(name)
    quantization = config.get("quantization") or config.get("quantization_config")
    reason = unsupported_reason(config.get("model_type"))
    if reason is not None:
        return Support(name, config.get("model_type"), False, reason)
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        adapter = TargetAdapter(model)
    except DSparkError as error:
        return Support(name, config.get("model_type"), False, str(error))
    except Exception as error:
        return Support(
            name,
            config.get("model_type"),
            False,
            f"mlx-lm cannot build this model from its config ({error}).",
        )
    return Support(
        name,
        model_type_of(model),
        True,
        rollback=adapter.rollback_kinds,
        tree=adapter.supports_tree,
        quantization=quantization,
    )
