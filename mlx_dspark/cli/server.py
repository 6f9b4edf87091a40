"""``mlx_dspark.server``: an OpenAI-compatible server with batched DSpark decoding.

Concurrent requests share one target forward per step; Algorithm 1 decides
how many drafts of each request it verifies (see :mod:`mlx_dspark.serving`).
"""

from __future__ import annotations

import json
import logging
import re
import sys

import typer

from ..errors import DSparkError
from ..proposers.suffix_files import SCOPES
from ..sampling.coupled import SAMPLING_METHODS, UNSEEDED_SAMPLING
from ..sampling.processing import SamplingParams
from .terminal import run_command


def _cli(
    model: str | None = typer.Option(
        None,
        "--model",
        help="Target model path or repo (default: the built-in default pair).",
    ),
    draft_model: str | None = typer.Option(
        None,
        "--draft-model",
        help="DSpark, DFlash or EAGLE-3 drafter path or repo for --model.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    dspark_n_draft: int | None = typer.Option(
        None,
        "--dspark-n-draft",
        help="Drafts per request per step at most (default: the drafter's block "
        "size); 0 serves plain batched decoding.",
    ),
    dspark_suffix: bool = typer.Option(
        False,
        "--dspark-suffix",
        help="Serve --model with no drafter: suffix drafts from each request's "
        "text and (scope global) from every request's output, verified "
        "losslessly.",
        metavar="",
    ),
    dspark_suffix_scope: str = typer.Option(
        "global",
        "--dspark-suffix-scope",
        help="global (one store per served model shared by all requests, "
        "written live) | request (each request drafts from its own text "
        "only, so requests never inform each other's timing).",
    ),
    dspark_suffix_store: str = typer.Option(
        "none",
        "--dspark-suffix-store",
        help="With --dspark-suffix-scope global: none (the default, in memory), "
        "auto (read at start from the user cache, suffix/<tokenizer "
        "fingerprint>.npz, written back when the server stops) or a file path.",
    ),
    dspark_adaptive: bool = typer.Option(
        True,
        "--dspark-adaptive/--no-dspark-adaptive",
        help="Skip drafting in steps where the measured costs and acceptance "
        "say it does not pay (drafting is re-tried every few steps).",
        metavar="",
    ),
    max_batch: int = typer.Option(
        8, "--decode-concurrency", help="Requests decoded together; more wait."
    ),
    temp: float = typer.Option(0.0, "--temp", help="Default sampling temperature."),
    top_p: float = typer.Option(1.0, "--top-p", help="Default top-p."),
    top_k: int = typer.Option(0, "--top-k", help="Default top-k (0: off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Default min-p (0: off)."),
    max_tokens: int = typer.Option(
        512, "--max-tokens", help="Default max_tokens of a request."
    ),
    context_length: int | None = typer.Option(
        None,
        "--context-length",
        help="Longest prompt plus completion (default: the model's "
        "max_position_embeddings, else 4096).",
    ),
    prefill_step_size: int = typer.Option(
        512, "--prefill-step-size", help="Prompt tokens per prefill forward."
    ),
    prompt_cache_size: int = typer.Option(
        10,
        "--prompt-cache-size",
        help="Most recent prompts (with their answers) whose caches are kept: a "
        "prompt that starts with one prefills only the rest (0: none).",
    ),
    prompt_cache_bytes: str | None = typer.Option(
        None,
        "--prompt-cache-bytes",
        help="Most bytes the prompt cache keeps, e.g. 500M or 2G (default: no limit).",
    ),
    chat_template_args: str = typer.Option(
        "{}", "--chat-template-args", help="JSON object passed to the chat template."
    ),
    allowed_origins: str = typer.Option(
        "*", "--allowed-origins", help="Comma-separated CORS origins ('*': any)."
    ),
    dspark_profile: str = typer.Option(
        "auto",
        "--dspark-profile",
        help="Cost profile the scheduler starts from: auto (the cached one, if "
        "any), refresh (measure it now), none. The server refines it with "
        "its own measured step times either way, and merges them into the "
        "cached profile (auto, refresh) so that a later start begins from them.",
    ),
    dspark_sampling: str | None = typer.Option(
        None,
        "--dspark-sampling",
        help="coupled | residual: how sampled drafts are verified, both exact "
        "(default: coupled for a request with a seed, whose tokens are then "
        "mlx_lm.generate's with that seed; else "
        f"{UNSEEDED_SAMPLING}).",
    ),
    adapter_path: str | None = typer.Option(
        None, "--adapter-path", help="LoRA/DoRA adapters for the target."
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Trust the tokenizer's remote code.",
        metavar="",
    ),
    log_level: str = typer.Option("INFO", "--log-level", help="Python logging level."),
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""
    from ..loading import load
    from ..policy.profile import get_profile, load_profile, trusted
    from ..policy.settings import build_settings
    from ..serving import BatchEngine

    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise DSparkError(f"--log-level {log_level!r} is not a logging level.")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    if model is None and draft_model is not None:
        raise DSparkError("--draft-model needs --model (the target it drafts for).")
    if dspark_suffix and draft_model is not None:
        raise DSparkError(
            "--dspark-suffix cannot be combined with a drafter yet; drop "
            "--draft-model to draft from the text alone."
        )
    if model is not None and draft_model is None and not dspark_suffix:
        raise DSparkError(
            "--model needs a DSpark --draft-model (or --dspark-suffix to serve "
            "it with suffix drafts)."
        )
    if dspark_suffix_scope not in SCOPES:
        raise DSparkError(
            "--dspark-suffix-scope must be global or request, got "
            f"{dspark_suffix_scope!r}."
        )
    if dspark_suffix_scope == "request" and dspark_suffix_store != "none":
        raise DSparkError(
            "--dspark-suffix-store keeps the global store; it needs "
            "--dspark-suffix-scope global."
        )
    if max_batch < 1:
        raise DSparkError(f"--decode-concurrency must be at least 1, got {max_batch}.")
    if prefill_step_size < 1:
        raise DSparkError(
            f"--prefill-step-size must be at least 1, got {prefill_step_size}."
        )
    if max_tokens < 1:
        raise DSparkError(f"--max-tokens must be at least 1, got {max_tokens}.")
    if prompt_cache_size < 0:
        raise DSparkError(
            f"--prompt-cache-size must be at least 0, got {prompt_cache_size}."
        )
    cache_bytes = None if prompt_cache_bytes is None else _size(prompt_cache_bytes)
    if not 0 < port < 65536:
        raise DSparkError(f"--port must be in 1..65535, got {port}.")
    SamplingParams(temp, top_p, top_k, min_p)  # refuses bad defaults
    try:
        template_args = json.loads(chat_template_args)
        if not isinstance(template_args, dict):
            raise ValueError
    except ValueError:
        raise DSparkError("--chat-template-args must be a JSON object.") from None
    if dspark_sampling not in (None, *SAMPLING_METHODS):
        raise DSparkError(
            f"--dspark-sampling must be coupled or residual, got {dspark_sampling!r}."
        )
    if dspark_profile not in ("auto", "refresh", "none"):
        raise DSparkError(
            f"--dspark-profile must be auto, refresh or none, got {dspark_profile!r}."
        )
    if dspark_suffix:
        return _serve_suffix(locals())
    loaded, tokenizer, drafter = load(
        model,
        draft_model,
        adapter_path=adapter_path,
        trust_remote_code=trust_remote_code,
    )
    if model is None:
        print(
            "No --model given: serving the built-in default pair, "
            "SmolLM2-135M-Instruct with the shipped DSpark drafter.",
            file=sys.stderr,
        )
    build_settings(
        drafter.block_size, dspark_n_draft, names={"num_draft": "--dspark-n-draft"}
    )  # refuses a draft count the drafter cannot make, naming the flag
    prior = None
    if dspark_profile == "auto":
        prior = load_profile(loaded, drafter)
        if prior is not None and not trusted(prior):
            prior = None  # the engine measures every step size it runs
    elif dspark_profile == "refresh":
        prior = get_profile(loaded, drafter, "refresh")
    engine = BatchEngine(
        loaded,
        tokenizer,
        drafter,
        _engine_config(locals(), dspark_n_draft, prior),
    )
    _serve(engine, tokenizer, locals())


def _engine_config(flags: dict, num_draft: int | None, prior=None):
    """The engine's configuration from the command's flags."""
    from ..serving import EngineConfig

    return EngineConfig(
        num_draft=num_draft,
        adaptive=flags["dspark_adaptive"],
        max_batch=flags["max_batch"],
        prefill_step_size=flags["prefill_step_size"],
        prior=prior,
        prompt_cache_size=flags["prompt_cache_size"],
        prompt_cache_bytes=flags["cache_bytes"],
        sampling=flags["dspark_sampling"],
    )


def _serve_suffix(flags: dict) -> None:
    """Serve ``--model`` (or the default pair's target) with suffix drafts and
    no drafter: one global store shared by all requests (scope global), or
    each request's own text only (scope request)."""
    from ..loading import load
    from ..policy.settings import build_settings
    from ..proposers.suffix import SUFFIX_MAX_DRAFT, SuffixProposer
    from ..proposers.suffix_files import ProcessStore, process_store
    from ..proposers.suffix_store import SuffixStore
    from ..serving import BatchEngine
    from ..targets.adapter import TargetAdapter

    target = flags["model"]
    if target is None:  # the default pair's target, without its drafter
        from ..pairs.default import named_pair

        target = named_pair(None)[0]
    loaded, tokenizer, _ = load(
        target,
        None,
        adapter_path=flags["adapter_path"],
        trust_remote_code=flags["trust_remote_code"],
    )
    if flags["model"] is None:
        print(
            "No --model given: serving the built-in default pair's target, "
            "SmolLM2-135M-Instruct, with suffix drafts.",
            file=sys.stderr,
        )
    num_draft = flags["dspark_n_draft"]
    build_settings(SUFFIX_MAX_DRAFT, num_draft, names={"num_draft": "--dspark-n-draft"})
    kept: ProcessStore | None = None
    store = None
    if flags["dspark_suffix_scope"] == "global":
        if flags["dspark_suffix_store"] == "none":
            store = SuffixStore()
        else:
            kept = process_store(tokenizer, tokenizer, flags["dspark_suffix_store"])
            store = kept.store
            if kept.note:
                print(kept.note, file=sys.stderr)
    engine = BatchEngine(
        loaded,
        tokenizer,
        None,
        _engine_config(flags, num_draft),
        proposer=SuffixProposer(TargetAdapter(loaded).vocab_size, store=store),
    )
    try:
        _serve(engine, tokenizer, flags)
    finally:
        failed = None if kept is None else kept.save()
        if failed:
            print(failed, file=sys.stderr)


def _serve(engine, tokenizer, flags: dict) -> None:
    """Bind and serve until interrupted; the engine stops at the end."""
    from ..serving import ServerSettings, make_server

    model, context_length = flags["model"], flags["context_length"]
    if context_length is None:
        args = getattr(engine.model, "args", None)
        context_length = int(getattr(args, "max_position_embeddings", 0) or 4096)
    host, port = flags["host"], flags["port"]
    settings = ServerSettings(
        model_name=model or "default_model",
        context_length=context_length,
        max_tokens=flags["max_tokens"],
        temperature=flags["temp"],
        top_p=flags["top_p"],
        top_k=flags["top_k"],
        min_p=flags["min_p"],
        chat_template_args=flags["template_args"],
        allowed_origins=tuple(o.strip() for o in flags["allowed_origins"].split(",")),
    )
    try:
        server = make_server(engine, tokenizer, settings, host, port)
    except OSError as error:
        engine.stop()
        raise DSparkError(
            f"Cannot listen on {host}:{port}: {error.strerror}."
        ) from None
    print(f"Serving on http://{host}:{server.server_address[1]}", file=sys.stderr)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        engine.stop()


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.server") -> None:
    """Run the server; user errors and bad flags end with one sentence."""
    run_command(_cli, argv, prog)


if __name__ == "__main__":
    main()


def _size(text: str) -> int:
    """Bytes from ``123``, ``500M``/``500MB`` or ``2G``/``2GB`` (as mlx-lm reads them)."""
    units = {"": 1, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).upper() not in units:
        raise DSparkError(
            f"--prompt-cache-bytes must be a size such as 500M or 2G, got {text!r}."
        )
    return int(float(match.group(1)) * units[match.group(2).upper()])
