"""The ``mlx_dspark.generate`` command, a drop-in for ``mlx_lm.generate``."""

from __future__ import annotations

import json
import sys

import typer

from .errors import DSparkError, run_cli
from .generation import generate


def _str2bool(value: str) -> bool:
    lowered = value.lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise DSparkError(f"--verbose expects true or false, got {value!r}.")
    return lowered in ("true", "1", "yes")


def _build_prompt(
    tokenizer, prompt, system_prompt, ignore_chat_template, chat_template_config
):
    """The prompt text, and whether special tokens still need adding."""
    template_kwargs = {}
    if chat_template_config is not None:
        try:
            template_kwargs = json.loads(chat_template_config)
        except json.JSONDecodeError:
            raise DSparkError("--chat-template-config is not valid JSON.") from None
        if not isinstance(template_kwargs, dict):
            raise DSparkError("--chat-template-config must be a JSON object.")
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    if ignore_chat_template or not tokenizer.has_chat_template:
        return prompt, True
    messages = (
        [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    )
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return text, False


def _cli(
    model: str | None = typer.Option(
        None,
        "--model",
        help="Target model path or Hugging Face repo (default: the built-in pair, "
        "SmolLM2-135M-Instruct and its DSpark drafter).",
    ),
    draft_model: str | None = typer.Option(
        None, "--draft-model", help="DSpark drafter path or Hugging Face repo."
    ),
    prompt: str = typer.Option(
        "hello", "--prompt", "-p", help="Prompt text, or - to read stdin."
    ),
    max_tokens: int = typer.Option(
        100, "--max-tokens", "-m", help="Maximum number of tokens to generate."
    ),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sampling top-p."),
    top_k: int = typer.Option(0, "--top-k", help="Sampling top-k."),
    min_p: float = typer.Option(0.0, "--min-p", help="Sampling min-p."),
    seed: int | None = typer.Option(None, "--seed", help="Random seed."),
    system_prompt: str | None = typer.Option(
        None, "--system-prompt", help="System prompt for the chat template."
    ),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="Use the prompt as is."
    ),
    chat_template_config: str | None = typer.Option(
        None, "--chat-template-config", help="JSON arguments for the chat template."
    ),
    verbose: str = typer.Option(
        "true", "--verbose", help="Print tokens and timing (true/false)."
    ),
    n_draft: int | None = typer.Option(
        None,
        "--dspark-n-draft",
        help="Drafts per round (at most the drafter's block size).",
    ),
    confidence_threshold: float = typer.Option(
        0.0,
        "--dspark-confidence-threshold",
        help="Cut drafts at the first confidence below this (0 = off).",
    ),
    scheduler: str | None = typer.Option(
        None,
        "--dspark-scheduler",
        help="off | threshold | auto | adaptive (default: adaptive, which picks "
        "the draft length, 0 included, with the best predicted tokens/s each "
        "round; with --dspark-n-draft: always that many).",
    ),
    profile: str = typer.Option(
        "auto",
        "--dspark-profile",
        help="auto (use the cached cost profile) | refresh (re-measure it).",
    ),
    tree_budget: int = typer.Option(
        0,
        "--dspark-tree",
        help="Draft a tree of this many nodes per round (0 = a chain).",
    ),
) -> None:
    """Generate text with a target model, sped up by a DSpark drafter."""
    from .default import default_pair
    from .loading import load

    show = _str2bool(verbose)
    if model is None:
        if draft_model is not None:
            raise DSparkError(
                "--draft-model needs --model (the target it was trained for)."
            )
        model, draft_model = default_pair()
        print(
            "No --model given: using the built-in default pair, SmolLM2-135M-Instruct "
            "with the shipped DSpark drafter.",
            file=sys.stderr,
        )
    target, tokenizer, drafter = load(model, draft_model)
    if tree_budget < 0:
        raise DSparkError(f"--dspark-tree must be >= 0, got {tree_budget}.")
    if drafter is None and (
        n_draft is not None
        or confidence_threshold
        or scheduler is not None
        or tree_budget
    ):
        raise DSparkError("--dspark-* options need --draft-model.")
    text, raw = _build_prompt(
        tokenizer, prompt, system_prompt, ignore_chat_template, chat_template_config
    )
    tokens = tokenizer.encode(text, add_special_tokens=raw)
    result = generate(
        target,
        tokenizer,
        drafter,
        tokens,
        verbose=show,
        max_tokens=max_tokens,
        temperature=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        num_draft=n_draft,
        confidence_threshold=confidence_threshold,
        scheduler=scheduler,
        profile=profile,
        tree_budget=tree_budget,
    )
    if not show:
        print(result)


def main() -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(_cli)
    run_cli(app)


if __name__ == "__main__":
    main()
