"""Anthropic's Messages API on top of the chat route.

A ``POST /v1/messages`` body becomes the OpenAI-style chat body the server
already takes (:func:`chat_body`): the system prompt a system message,
``tool_use`` blocks an assistant message's ``tool_calls``, ``tool_result``
blocks ``role: "tool"`` messages, each tool's ``input_schema`` a function's
``parameters``, ``stop_sequences`` stop strings. The answer's
:class:`~mlx_dspark.serving.tool_calls.Delta` s become content blocks
(:class:`MessageBuilder`): text, ``thinking`` and ``tool_use``, or the
server-sent events that stream them.
"""

from __future__ import annotations

import datetime
import json

from .errors import BadRequest
from .tool_calls import Delta, Finish, new_id

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    411: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict:
    """An error in Anthropic's shape, its type from the HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text_blocks(content, where: str) -> str:
    """A string, or the text of a list of ``text`` blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks.")
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise BadRequest(_unsupported(kind, f"{where}[{i}]"))
        if not isinstance(block.get("text"), str):
            raise BadRequest(f"{where}[{i}] needs a string text.")
        parts.append(block["text"])
    return "".join(parts)


def _unsupported(kind, where: str) -> str:
    if kind in ("image", "document"):
        return f"{where}: {kind} blocks are not supported by this server (text only)."
    if not isinstance(kind, str):
        return f"{where} must be a content block with a type."
    return f"{where}: a {kind!r} block is not supported here."


def _user_messages(content, i: int, names: dict[str, str]) -> list[dict]:
    """A user turn: its text one user message, each ``tool_result`` a tool
    message, in the order given."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks.")
    out, text = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise BadRequest(f"{where}[{j}] needs a string text.")
            text.append(block["text"])
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}[{j}] needs a string tool_use_id.")
            result = block.get("content")
            result = "" if result is None else _text_blocks(result, f"{where}[{j}]")
            if block.get("is_error"):
                result = f"Error: {result}"
            message = {"role": "tool", "tool_call_id": call_id, "content": result}
            if call_id in names:
                message["name"] = names[call_id]
            out.append(message)
        else:
            raise BadRequest(_unsupported(kind, f"{where}[{j}]"))
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_message(content, i: int, names: dict[str, str]) -> dict:
    """An assistant turn: its text, its ``tool_use`` blocks as tool_calls and
    its thinking as ``reasoning_content`` (what thinking templates read)."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks.")
    text, thinking, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise BadRequest(f"{where}[{j}] needs a string text.")
            text.append(block["text"])
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise BadRequest(f"{where}[{j}] needs a string id and name.")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise BadRequest(f"{where}[{j}].input must be an object.")
            names[call_id] = name
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        else:
            raise BadRequest(_unsupported(kind, f"{where}[{j}]"))
    message = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list.")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}] must be an object with a string name.")
        kind = tool.get("type", "custom")
        schema = tool.get("input_schema")
        if kind not in (None, "custom") or not isinstance(schema, dict):
            raise BadRequest(
                f"tools[{i}] ({tool['name']}): only custom tools with an "
                "input_schema are supported."
            )
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> str:
    """The choice's type. "any" and "tool" cannot be forced (generation is
    lossless, never constrained): they behave as "auto"."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise BadRequest("tool_choice.type must be auto, any, tool or none.")
    if kind == "tool":
        names = [t["function"]["name"] for t in tools or []]
        if choice.get("name") not in names:
            raise BadRequest("tool_choice names a tool that is not in tools.")
    return kind


def chat_body(body, *, count: bool = False) -> dict:
    """A Messages request as the chat route's body; BadRequest if invalid.
    ``count``: a count_tokens request (no ``max_tokens``). Fields with no
    effect here (``metadata``, ``cache_control`` on blocks, ...) are left
    alone."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    max_tokens = body.get("max_tokens")
    if not count and max_tokens is None:
        raise BadRequest("max_tokens is required.", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean.", "stream")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list.", "messages")
    chat = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            chat.append({"role": "system", "content": text})
    names: dict[str, str] = {}
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be user or assistant.")
        content = message.get("content")
        if role == "user":
            chat += _user_messages(content, i, names)
        else:
            chat.append(_assistant_message(content, i, names))
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    stop = body.get("stop_sequences")
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise BadRequest("stop_sequences must be a list of strings.")
    out = {"messages": chat, "stream": stream}
    for name in ("model", "max_tokens", "temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    if stop:
        out["stop"] = stop
    if tools is not None and choice != "none":
        out["tools"] = tools
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict):
            raise BadRequest("thinking must be an object.")
        # Templates take a switch, not a budget: any type but "disabled" is on.
        out["chat_template_kwargs"] = {
            "enable_thinking": thinking.get("type") != "disabled"
        }
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("format") is not None:
        raise BadRequest(
            "output_config.format (structured outputs) is not supported: "
            "generation here is never constrained."
        )
    return out


def usage(engine_usage: dict | None, prompt_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from
    the prompt cache (so the three input counts add up to the prompt)."""
    details = (engine_usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    cached = cached if isinstance(cached, int) and 0 <= cached <= prompt_tokens else 0
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(finish: Finish, made_tool_call: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for how it ended."""
    if finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    if finish.reason in ("length", "cancelled"):
        return "max_tokens", None
    return ("tool_use" if made_tool_call else "end_turn"), None


class MessageBuilder:
    """One answer as a Messages response: ``add`` the deltas as they come
    (it returns the stream events they complete, ``(name, data)`` pairs),
    ``finish`` at the end; ``message`` is the whole non-streamed body."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id = new_id("msg_")
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.blocks: list[dict] = []
        self.open: str | None = None  # the kind of the last block, if open
        self.made_tool_call = False
        self.result: dict | None = None

    def start(self) -> list[tuple[str, dict]]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(None, self.prompt_tokens, 0),
        }
        return [
            ("message_start", {"type": "message_start", "message": message}),
            ("ping", {"type": "ping"}),
        ]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        index = len(self.blocks) - 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _begin(self, block: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self.blocks.append(block)
        self.open = block["type"]
        start = {**block}
        if block["type"] == "tool_use":
            start["input"] = {}
        elif block["type"] == "text":
            start["text"] = ""
        else:
            start["thinking"] = ""
        event = {
            "type": "content_block_start",
            "index": len(self.blocks) - 1,
            "content_block": start,
        }
        return [*events, ("content_block_start", event)]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        event = {
            "type": "content_block_delta",
            "index": len(self.blocks) - 1,
            "delta": delta,
        }
        return ("content_block_delta", event)

    def add(self, delta: Delta) -> list[tuple[str, dict]]:
        events = []
        if delta.kind == "tool_call":
            call = delta.call
            self.made_tool_call = True
            block = {
                "type": "tool_use",
                "id": call.id or new_id("toolu_"),
                "name": call.name,
                "input": call.arguments,
            }
            events += self._begin(block)
            events.append(
                self._delta(
                    {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(call.arguments, ensure_ascii=False),
                    }
                )
            )
            return events + self._close()
        kind, key = (
            ("text", "text") if delta.kind == "text" else ("thinking", "thinking")
        )
        if self.open != kind:
            block = {"type": kind, key: ""}
            if kind == "thinking":
                block["signature"] = ""
            events += self._begin(block)
        self.blocks[-1][key] += delta.text
        events.append(self._delta({"type": f"{key}_delta", key: delta.text}))
        return events

    def finish(self, finish: Finish) -> list[tuple[str, dict]]:
        events = self._close()
        reason, sequence = stop_reason(finish, self.made_tool_call)
        engine_usage = finish.usage or {}
        output = engine_usage.get("completion_tokens", 0)
        counts = usage(engine_usage, self.prompt_tokens, output)
        self.result = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": self.blocks,
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": counts,
        }
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": counts,
        }
        return [
            *events,
            ("message_delta", delta),
            ("message_stop", {"type": "message_stop"}),
        ]


def models_list(settings) -> dict:
    """``GET /v1/models`` in Anthropic's shape (asked with ``anthropic-version``)."""
    created = datetime.datetime.fromtimestamp(settings.created, datetime.timezone.utc)
    model = {
        "type": "model",
        "id": settings.model_name,
        "display_name": settings.model_name,
        "created_at": created.isoformat().replace("+00:00", "Z"),
    }
    return {
        "data": [model],
        "has_more": False,
        "first_id": model["id"],
        "last_id": model["id"],
    }
