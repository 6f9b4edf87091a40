"""``mlx_dspark.load``: a target and its drafter, or a built-in pair."""

from __future__ import annotations

from pathlib import Path

from .checkpoints.loading import load_pair
from .errors import DSparkError


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
    (``"smollm2-135m"``, ``"gemma3-270m"``; see :mod:`mlx_dspark.pairs`), the
    default is SmolLM2-135M-Instruct and its drafter. ``adapter_path``,
    ``model_config`` and ``trust_remote_code`` apply to the target, as in
    ``mlx_lm.load``; the drafter verifies against the adapted target, so
    output stays the adapted target's own.
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
        from .pairs.default import named_pair

        target, draft_model = named_pair(pair)
    return load_pair(
        target,
        draft_model,
        tokenizer_config,
        adapter_path=adapter_path,
        model_config=model_config,
        trust_remote_code=trust_remote_code,
    )
