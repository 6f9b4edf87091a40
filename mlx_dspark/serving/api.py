"""HTTP front end of :class:`~mlx_dspark.serving.engine.BatchEngine`.

OpenAI's API as ``mlx_lm.server`` serves it: ``POST /v1/chat/completions``
(tool calls and reasoning split out by :mod:`.tool_calls`) and
``/v1/completions`` (server-sent events when ``stream`` is true), ``GET
/v1/models``, ``/health`` and ``/metrics`` (Prometheus text); and Anthropic's
``POST /v1/messages`` and ``/v1/messages/count_tokens`` (:mod:`.anthropic`
maps them onto the chat route). Standard library only: a threading HTTP
server whose handler threads tokenize, queue the request on the engine and
write what it commits; all MLX work stays on the engine thread. Bad input
gets a JSON error with status 400 and never reaches the engine.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import select
import socket
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx

from ..errors import DSparkError
from ..policy.telemetry import render_prometheus
from ..sampling.processing import SamplingParams
from .anthropic import MessageBuilder, anthropic_error, chat_body, models_list
from .engine import BatchEngine, Event, GenerationRequest, RequestHandle
from .errors import BadRequest, ModelNotFound
from .segments import segment_ends
from .tool_calls import ChatOutput, Delta, Finish, openai_tool_call, template_tool_calls

logger = logging.getLogger("mlx_dspark.server")


UNSUPPORTED = (
    "logit_bias",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


POST_ROUTES = {
    "/v1/completions": False,
    "/completions": False,
    "/v1/chat/completions": True,
    "/chat/completions": True,
}  # path -> whether it is a chat route
# Anthropic's Messages API: path -> whether it only counts the prompt's tokens.
MESSAGES_ROUTES = {"/v1/messages": False, "/v1/messages/count_tokens": True}
GET_ROUTES = ("/v1/models", "/models", "/health", "/metrics")


@dataclass
class ServerSettings:
    """What the handlers need besides the engine: defaults for omitted fields."""

    model_name: str = "default_model"
    context_length: int = 4096
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: dict = field(default_factory=dict)
    allowed_origins: tuple[str, ...] = ("*",)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ParsedRequest:
    request: GenerationRequest
    stream: bool
    include_usage: bool
    stop: list[str]
    chat: bool
    model: str
    tools: list | None = None  # the chat request's tools, OpenAI's shape


def _number(
    body: dict, name: str, default: float, low=None, high=None, *, open_low=False
):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number.", name)
    value = float(value)
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number.", name)
    if low is not None and (value <= low if open_low else value < low):
        raise BadRequest(f"{name} must be {'>' if open_low else '>='} {low}.", name)
    if high is not None and value > high:
        raise BadRequest(f"{name} must be <= {high}.", name)
    return value


def _integer(body: dict, name: str, default, low=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer.", name)
    if low is not None and value < low:
        raise BadRequest(f"{name} must be >= {low}.", name)
    return value


def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(
                    f"{where}: only text content parts are supported.", "messages"
                )
            if not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"{where}: a text part needs a string text.", "messages"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(
        f"{where}: content must be a string or a list of parts.", "messages"
    )


def _plain_chat(messages: list[dict]) -> str:
    """The chat format mlx-lm's server uses for tokenizers without a template."""
    prefixes = {
        "system": "ASSISTANT's RULE: ",
        "user": "USER: ",
        "assistant": "ASSISTANT: ",
    }
    text = (
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant follows the given rules no matter what.\n"
    )
    for m in messages:
        text += f"{prefixes.get(m['role'], '')}{m['content']}\n"
    return (text + "ASSISTANT: ").rstrip()


def chat_prompt(tokenizer, body: dict, template_args: dict) -> list[int]:
    return _rendered(tokenizer, body, template_args)[0]


def chat_prompt_segments(
    tokenizer, body: dict, template_args: dict
) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's token ids and where its segments end (:mod:`.segments`)."""
    ids, render, messages = _rendered(tokenizer, body, template_args)
    return ids, segment_ends(render, messages, ids)


def _rendered(tokenizer, body: dict, template_args: dict):
    """The prompt's token ids, the function that rendered them (for a list
    of messages, without the generation prompt by default) and the messages
    it rendered."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list.", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(
                f"messages[{i}] must be an object with a string role.", "messages"
            )
        message = {**m, "content": _content_text(m.get("content"), f"messages[{i}]")}
        try:
            calls = template_tool_calls(m, f"messages[{i}]")
        except ValueError as error:
            raise BadRequest(str(error), "messages") from None
        if calls is not None:
            message["tool_calls"] = calls
        clean.append(message)
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list.", "tools")
    if getattr(tokenizer, "has_chat_template", False) and tokenizer.chat_template:
        kwargs = dict(template_args)
        extra = body.get("chat_template_kwargs")
        if extra is not None:
            if not isinstance(extra, dict):
                raise BadRequest("chat_template_kwargs must be an object.")
            kwargs.update(extra)
        if tools and not getattr(tokenizer, "has_tool_calling", False):
            logger.warning("tools given, but this model's tool-call format is unknown")

        def render(messages: list[dict], generation: bool = False) -> list[int]:
            ids = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=generation,
                tokenize=True,
                **kwargs,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]

        try:
            ids = render(clean, True)
        except Exception as error:
            raise BadRequest(f"The chat template failed: {error}", "messages") from None
    else:

        def render(messages: list[dict], generation: bool = False) -> list[int]:
            return list(tokenizer.encode(_plain_chat(messages)))

        ids = render(clean)
    return ids, render, clean


def text_prompt(tokenizer, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        return list(
            tokenizer.encode(
                prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
            )
        )
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise BadRequest("prompt must be a string or a list of token ids.", "prompt")


def check_model(body: dict, settings: ServerSettings) -> str:
    """The requested model's name; ModelNotFound if it is not this one."""
    model = body.get("model", settings.model_name)
    if not isinstance(model, str):
        raise BadRequest("model must be a string.", "model")
    if model not in (settings.model_name, "default_model"):
        raise ModelNotFound(
            f"The model {model!r} does not exist: this server serves "
            f"{settings.model_name!r}.",
            "model",
        )
    return model


def parse_request(
    body, chat: bool, tokenizer, settings: ServerSettings, vocab_size: int
) -> ParsedRequest:
    """Check a completion request's fields and tokenize it; BadRequest if invalid."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object.", "stream_options")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, name, settings.max_tokens)
    if max_tokens < 1:
        raise BadRequest(f"{name} must be at least 1.", name)
    temperature = _number(body, "temperature", settings.temperature, 0.0)
    top_p = _number(body, "top_p", settings.top_p, 0.0, 1.0, open_low=True)
    top_k = _integer(body, "top_k", settings.top_k, 0)
    min_p = _number(body, "min_p", settings.min_p, 0.0, 1.0)
    seed = _integer(body, "seed", None)
    xtc_probability = _number(body, "xtc_probability", 0.0, 0.0, 1.0)
    xtc_threshold = _number(body, "xtc_threshold", 0.1, 0.0, 0.5)
    # Logit processors the lossless verification does not apply: refused
    # rather than silently ignored.
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0, {}):
            raise BadRequest(f"{name} is not supported by this server.", name)
    if _integer(body, "n", 1) != 1:
        raise BadRequest("Only n = 1 completion per request is supported.", "n")
    logprobs = body.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if isinstance(logprobs, bool):
        pass
    elif isinstance(logprobs, int) and logprobs >= 0 and not chat:
        logprobs = logprobs > 0  # completions: a count; the chosen token's only
    else:
        raise BadRequest("logprobs must be a boolean.", "logprobs")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop must be a string or a list of strings.", "stop")
    stop = [s for s in stop if s]
    model = check_model(body, settings)
    segments = ()
    if chat:
        prompt, segments = chat_prompt_segments(
            tokenizer, body, settings.chat_template_args
        )
    else:
        prompt = text_prompt(tokenizer, body)
    if not prompt:
        raise BadRequest("The prompt is empty.", "messages" if chat else "prompt")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise BadRequest(f"Prompt token ids must lie in 0..{vocab_size - 1}.", "prompt")
    if len(prompt) >= settings.context_length:
        raise BadRequest(
            f"The prompt has {len(prompt)} tokens; this model's context is "
            f"{settings.context_length} tokens.",
            "messages" if chat else "prompt",
        )
    max_tokens = min(max_tokens, settings.context_length - len(prompt))
    special = tuple(tokenizer.encode("\n")) + tuple(tokenizer.eos_token_ids)
    try:
        params = SamplingParams(
            temperature,
            top_p,
            top_k,
            min_p,
            xtc_probability=xtc_probability,
            xtc_threshold=xtc_threshold,
            xtc_special_tokens=tuple(int(t) for t in special),
        )
    except DSparkError as error:
        raise BadRequest(str(error)) from None
    request = GenerationRequest(
        prompt, params, max_tokens, seed, logprobs, segments=segments
    )
    return ParsedRequest(
        request,
        stream,
        bool(options.get("include_usage")),
        stop,
        chat,
        model,
        (body.get("tools") or None) if chat else None,
    )


class StopText:
    """Detokenized text with stop strings cut out.

    ``push`` returns the text that is safe to send: everything before a stop
    string, and never a tail that could still become one.
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that cut the text

    def push(self, text: str, final: bool = False) -> str:
        self.pending += text
        hits = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending, self.stopped = self.pending[:at], "", True
            return out
        keep = 0 if final else min(self.hold, len(self.pending))
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out


def error_body(
    message: str,
    param: str | None = None,
    kind="invalid_request_error",
    code: str | None = None,
):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _client_gone(sock: socket.socket) -> bool:
    """Whether the client closed its end (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class APIHandler(BaseHTTPRequestHandler):
    """One HTTP request; ``server`` is a :class:`DSparkHTTPServer`."""

    protocol_version = "HTTP/1.1"
    server: DSparkHTTPServer
    anthropic = False  # whether the route is Anthropic's (errors in its shape)

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        logger.debug("%s - %s", self.address_string(), format % args)

    # -- plumbing ----------------------------------------------------------

    def _headers(
        self,
        status: int,
        content_type: str,
        length: int | None = None,
        close: bool = False,
    ):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if close:
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
        origins = self.server.settings.allowed_origins
        origin = self.headers.get("Origin")
        if "*" in origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin in origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", "*")
        self.send_header("Access-Control-Allow-Headers", "*")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self._headers(status, "application/json", len(data))
        self.wfile.write(data)
        self.wfile.flush()

    def _send_text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        self._headers(status, content_type, len(data))
        self.wfile.write(data)
        self.wfile.flush()

    def do_OPTIONS(self):
        self._headers(204, "application/json", 0)

    def _error(
        self, status: int, message: str, param=None, kind=None, code=None
    ) -> None:
        """An error body in the shape of the route's API."""
        if self.anthropic:
            self._send_json(status, anthropic_error(status, message))
            return
        if kind is None:
            kind = {404: "not_found", 500: "server_error", 503: "server_error"}.get(
                status, "invalid_request_error"
            )
        self._send_json(status, error_body(message, param, kind, code))

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        self.anthropic = path in MESSAGES_ROUTES
        if path in ("/v1/models", "/models"):
            settings = self.server.settings
            if self.headers.get("anthropic-version"):
                self._send_json(200, models_list(settings))
                return
            model = {
                "id": settings.model_name,
                "object": "model",
                "created": settings.created,
                "owned_by": "mlx_dspark",
            }
            self._send_json(200, {"object": "list", "data": [model]})
        elif path == "/health":
            ok = self.server.engine.alive
            self._send_json(
                200 if ok else 503, {"status": "ok" if ok else "unavailable"}
            )
        elif path == "/metrics":
            self._send_text(
                200, metrics_text(self.server.engine), "text/plain; version=0.0.4"
            )
        elif path in POST_ROUTES or self.anthropic:
            self._wrong_method(path, "POST")
        else:
            self._error(404, f"Not found: {path}")

    def _wrong_method(self, path: str, allowed: str) -> None:
        message = f"{path} takes {allowed} requests only."
        if self.anthropic:
            body = anthropic_error(405, message)
        else:
            body = error_body(message, kind="invalid_request_error")
        data = json.dumps(body).encode()
        self.send_response(405)
        self.send_header("Allow", allowed)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        self.anthropic = path in MESSAGES_ROUTES
        length = self.headers.get("Content-Length")
        try:
            length = int(length)
            if length < 0:
                raise ValueError
        except (TypeError, ValueError):
            self.close_connection = True
            self._error(411, "A valid Content-Length header is required.")
            return
        raw = self.rfile.read(length)
        if path in GET_ROUTES:
            self._wrong_method(path, "GET")
            return
        if path not in POST_ROUTES and not self.anthropic:
            self._error(404, f"Not found: {path}")
            return
        engine = self.server.engine
        if not engine.alive:
            self._error(503, "The generation engine is not running.")
            return
        server = self.server
        try:
            try:
                body = json.loads(raw.decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise BadRequest(f"Invalid JSON in the request body: {error}") from None
            chat = POST_ROUTES.get(path, True)
            if self.anthropic:
                body = chat_body(body, count=MESSAGES_ROUTES[path])
                if MESSAGES_ROUTES[path]:
                    check_model(body, server.settings)
                    prompt = chat_prompt(
                        server.tokenizer, body, server.settings.chat_template_args
                    )
                    self._send_json(200, {"input_tokens": len(prompt)})
                    return
            parsed = parse_request(
                body, chat, server.tokenizer, server.settings, engine.target.vocab_size
            )
        except ModelNotFound as error:
            self._error(404, str(error), error.param, code="model_not_found")
            return
        except BadRequest as error:
            self._error(400, str(error), error.param)
            return
        handle = engine.submit(parsed.request)
        try:
            if self.anthropic:
                self._respond_messages(parsed, handle)
            else:
                self._respond(parsed, handle)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            logger.info("client went away; request cancelled")
            self.close_connection = True
        finally:
            handle.cancel()

    # -- completions -------------------------------------------------------

    def _events(self, handle: RequestHandle):
        """The request's events; cancels it when the client disconnects."""
        while True:
            try:
                event = handle.events.get(timeout=0.05)
            except queue.Empty:
                if not self.server.engine.alive:
                    event = Event([], finish_reason="error", error="engine stopped")
                    yield event
                    return
                if _client_gone(self.connection):
                    handle.cancel()
                    raise ConnectionResetError("client disconnected") from None
                continue
            yield event
            if event.finish_reason is not None:
                return

    def _generated(self, parsed: ParsedRequest, handle: RequestHandle):
        """``(text, tokens, logprobs)`` for each of the request's events, the
        text detokenized and cut at the first stop string; then a
        :class:`Finish`."""
        detokenizer = self.server.tokenizer.detokenizer
        stop = StopText(parsed.stop)
        produced = 0
        finish, usage = None, None
        events = self._events(handle)
        for event in events:
            event: Event
            new = ""
            for token in event.tokens:
                detokenizer.add_token(token)
                new += detokenizer.last_segment
            if event.finish_reason is not None:
                detokenizer.finalize()
                new += detokenizer.last_segment
                finish, usage = event.finish_reason, event.usage
            produced += len(event.tokens)
            piece = stop.push(new, final=event.finish_reason is not None)
            if stop.stopped:
                finish = "stop"
                handle.cancel("stop")
            yield piece, event.tokens, event.logprobs
            if stop.stopped:
                break
        if stop.stopped:
            # Cut by a stop string: the engine's statistics (it leaves at its
            # next step), the tokens up to the stop.
            for event in events:
                usage = event.usage
            prompt = len(parsed.request.prompt)
            usage = dict(usage or {})
            usage["prompt_tokens"] = prompt
            usage["completion_tokens"] = produced
            usage["total_tokens"] = prompt + produced
        yield Finish(finish, usage or {}, stop.matched)

    def _respond(self, parsed: ParsedRequest, handle: RequestHandle) -> None:
        tokenizer = self.server.tokenizer
        output = None
        if parsed.chat:
            output = ChatOutput(tokenizer, parsed.request.prompt, parsed.tools)
        rid = ("chatcmpl-" if parsed.chat else "cmpl-") + str(uuid.uuid4())
        created = int(time.time())
        kind = "chat.completion" if parsed.chat else "text_completion"
        if parsed.stream and parsed.chat:
            kind = "chat.completion.chunk"

        def payload(text, finish, tokens=(), logprobs=None, usage=None, extra=None):
            choice = {"index": 0, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = {
                    "content": [
                        {"id": t, "token": tokenizer.decode([t]), "logprob": g}
                        for t, g in zip(tokens, logprobs, strict=True)
                    ]
                }
            if parsed.chat:
                key = "delta" if parsed.stream else "message"
                choice[key] = {"role": "assistant"}
                if not parsed.stream or text:
                    choice[key]["content"] = text if (text or parsed.stream) else None
                choice[key].update(extra or {})
            else:
                choice["text"] = text
            out = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": parsed.model,
                "system_fingerprint": "mlx_dspark",
                "choices": [choice],
            }
            if usage is not None:
                out["usage"] = usage
            return out

        if parsed.stream:
            # No length is known in advance: the stream ends with the connection.
            self.close_connection = True
            self._headers(200, "text/event-stream", close=True)

        def send(data: dict) -> None:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        text, reasoning, calls, tokens, logprobs = "", "", [], [], []
        finish = Finish(None)
        for item in self._generated(parsed, handle):
            if isinstance(item, Finish):
                finish, piece, new, lps = item, "", [], None
                deltas = output.finish() if output is not None else []
            else:
                piece, new, lps = item
                tokens += new
                if lps is not None:
                    logprobs += lps
                if output is not None:
                    deltas = output.push(piece)
                else:
                    deltas = [Delta("text", piece)] if piece else []
            said = "".join(d.text for d in deltas if d.kind == "text")
            thought = "".join(d.text for d in deltas if d.kind == "reasoning")
            made = [d.call for d in deltas if d.kind == "tool_call"]
            if parsed.stream and (said or thought or made):
                extra = {}
                if thought:
                    extra["reasoning"] = thought
                if made:
                    extra["tool_calls"] = [
                        openai_tool_call(c, len(calls) + i) for i, c in enumerate(made)
                    ]
                if not parsed.request.logprobs or lps is None or len(lps) != len(new):
                    lps = None
                send(payload(said, None, new, lps, extra=extra))
            text, reasoning, calls = text + said, reasoning + thought, calls + made
        usage = finish.usage
        if finish.reason == "error":
            message = "generation failed"
            if parsed.stream:
                send(error_body(message, kind="server_error"))
                self.wfile.write(b"data: [DONE]\n\n")
                return
            self._send_json(500, error_body(message, kind="server_error"))
            return
        reason = "length" if finish.reason == "cancelled" else finish.reason
        if reason == "stop" and output is not None and output.made_tool_call:
            reason = "tool_calls"
        if parsed.stream:
            send(payload("", reason))
            if parsed.include_usage:
                final = payload("", None, usage=usage)
                final["choices"] = []
                send(final)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            return
        lps = logprobs if parsed.request.logprobs else None
        if lps is not None and len(lps) != len(tokens):
            lps = None
        extra = {}
        if reasoning:
            extra["reasoning"] = reasoning
        if calls:
            extra["tool_calls"] = [openai_tool_call(c) for c in calls]
        self._send_json(200, payload(text, reason, tokens, lps, usage, extra))

    def _respond_messages(self, parsed: ParsedRequest, handle: RequestHandle) -> None:
        """Anthropic's Messages answer: one message, or its event stream."""
        builder = MessageBuilder(parsed.model, len(parsed.request.prompt))
        output = ChatOutput(self.server.tokenizer, parsed.request.prompt, parsed.tools)

        def send(events: list[tuple[str, dict]]) -> None:
            for name, data in events:
                self.wfile.write(
                    f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                )
            self.wfile.flush()

        if parsed.stream:
            self.close_connection = True
            self._headers(200, "text/event-stream", close=True)
            send(builder.start())
        for item in self._generated(parsed, handle):
            if isinstance(item, Finish):
                events = [e for d in output.finish() for e in builder.add(d)]
                if item.reason == "error":
                    if parsed.stream:
                        send(
                            [
                                *events,
                                (
                                    "error",
                                    anthropic_error(500, "Generation failed."),
                                ),
                            ]
                        )
                    else:
                        self._error(500, "Generation failed.")
                    return
                events += builder.finish(item)
            else:
                events = [e for d in output.push(item[0]) for e in builder.add(d)]
            if parsed.stream and events:
                send(events)
        if not parsed.stream:
            self._send_json(200, builder.result)


def metrics_text(engine: BatchEngine) -> str:
    """Prometheus text: the scheduler's DSpark metrics and the server's own."""
    s = engine.stats
    telemetry = engine.telemetry
    telemetry.memory_active_bytes = mx.get_active_memory()
    speedup = None if engine.gate is None else engine.gate.speedup(max(s.active, 1))
    telemetry.speedup_ratio = float("nan") if speedup is None else speedup
    lines = [render_prometheus(telemetry).rstrip("\n")]
    for name, kind, help_text, value in (
        ("dspark_server_requests_total", "counter", "Requests received.", s.requests),
        (
            "dspark_server_requests_finished_total",
            "counter",
            "Requests finished.",
            s.finished,
        ),
        (
            "dspark_server_requests_cancelled_total",
            "counter",
            "Requests cancelled or disconnected.",
            s.cancelled,
        ),
        (
            "dspark_server_requests_failed_total",
            "counter",
            "Requests that failed.",
            s.failed,
        ),
        (
            "dspark_server_active_requests",
            "gauge",
            "Requests in the running batch.",
            s.active,
        ),
        (
            "dspark_server_waiting_requests",
            "gauge",
            "Requests waiting to join the batch.",
            s.waiting,
        ),
        (
            "dspark_server_target_forwards_total",
            "counter",
            "Batched target verification forwards.",
            s.target_forwards,
        ),
        (
            "dspark_server_request_rounds_total",
            "counter",
            "Request rounds verified (sum of batch sizes).",
            s.request_rounds,
        ),
        (
            "dspark_server_max_batch_size",
            "gauge",
            "Largest batch verified in one forward.",
            s.max_batch,
        ),
        (
            "dspark_server_prefill_forwards_total",
            "counter",
            "Target forwards prefilling prompt chunks (several prompts each).",
            s.prefill_forwards,
        ),
        (
            "dspark_server_prompt_tokens_total",
            "counter",
            "Prompt tokens of the requests started (cached ones included).",
            s.prompt_tokens,
        ),
        (
            "dspark_server_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from the prompt cache instead of prefilled.",
            s.prompt_tokens_cached,
        ),
        (
            "dspark_server_generated_tokens_total",
            "counter",
            "Tokens generated.",
            s.generated_tokens,
        ),
        *(_suffix_metrics(s) if engine.offers else ()),
    ):
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} {kind}",
            f"{name} {value}",
        ]
    return "\n".join(lines) + "\n"


def _suffix_metrics(s) -> tuple:
    """The ``dspark_suffix_*`` metrics of an engine drafting suffix drafts."""
    return (
        (
            "dspark_suffix_rounds_total",
            "counter",
            "Request rounds that verified a suffix draft.",
            s.suffix_rounds,
        ),
        (
            "dspark_suffix_accepted_tokens_total",
            "counter",
            "Suffix draft tokens accepted.",
            s.suffix_accepted,
        ),
        (
            "dspark_suffix_global_rounds_total",
            "counter",
            "Request rounds whose suffix draft came from the global store "
            "(other requests' output).",
            s.suffix_global_rounds,
        ),
        (
            "dspark_suffix_global_accepted_tokens_total",
            "counter",
            "Suffix draft tokens accepted from the global store.",
            s.suffix_global_accepted,
        ),
        (
            "dspark_suffix_store_tokens",
            "gauge",
            "Tokens held by the global suffix store.",
            s.suffix_store_tokens,
        ),
        (
            "dspark_suffix_store_documents",
            "gauge",
            "Responses held by the global suffix store.",
            s.suffix_store_documents,
        ),
    )


class DSparkHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding the engine, tokenizer and settings."""

    daemon_threads = True

    def __init__(
        self, address, engine: BatchEngine, tokenizer, settings: ServerSettings
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        super().__init__(address, APIHandler)


def make_server(
    engine: BatchEngine,
    tokenizer,
    settings: ServerSettings | None = None,
    host: str = "127.0.0.1",
    port: int = 8080,
) -> DSparkHTTPServer:
    """Bind the server (port 0 picks a free one); start the engine if needed.

    Call ``serve_forever()`` on the result; ``shutdown()`` and
    ``engine.stop()`` end it.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if not engine.alive:
        engine.start()
    return DSparkHTTPServer(
        (host, port), engine, tokenizer, settings or ServerSettings()
    )
