"""A chat answer's text split into content, reasoning and tool calls.

The split is mlx-lm's own: the tokenizer that ``mlx_lm.load`` returns names
the model's tool-call markers and parser (inferred from its chat template)
and its thinking markers, and ``mlx_lm.generate.make_text_state_machine``
walks the generated text through them. So a model answers tool calls here
exactly as ``mlx_lm.server`` reads them, with one difference: a call the
parser cannot read is given back as text (markers included), never dropped.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

from mlx_lm.generate import TextStateMachine, make_text_state_machine

logger = logging.getLogger("mlx_dspark.server")


@dataclass
class ToolCall:
    """One call the model made: the tool's name and its arguments (an object).
    ``id`` is the model's own, when its format has one."""

    name: str
    arguments: dict
    id: str | None = None


@dataclass
class Delta:
    """A piece of the answer: ``kind`` is "text", "reasoning" or "tool_call"."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


@dataclass
class Finish:
    """How a request ended: ``reason`` is the engine's ("stop", "length",
    "cancelled", "error"), or "stop" with ``stop_sequence`` when a stop
    string cut it; ``usage`` is the engine's usage dict."""

    reason: str | None
    usage: dict = field(default_factory=dict)
    stop_sequence: str | None = None


def _calls(parsed) -> list[ToolCall] | None:
    """The parser's result as calls; None if it is not a list of calls."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        call_id = item.get("id")
        calls.append(ToolCall(item["name"], arguments, call_id or None))
    return calls or None


class ChatOutput:
    """Feed it the generated text piece by piece (``push``), then ``finish``;
    each returns the :class:`Delta` s that became certain. Tool calls come
    out whole, when their end marker (or the end of the answer) is reached.

    ``tools`` are the request's tools in OpenAI's shape (some parsers read
    the argument types from them); ``prompt`` the prompt's token ids (an
    answer whose prompt opened a thinking block starts in its reasoning).
    """

    def __init__(self, tokenizer, prompt: list[int], tools: list | None = None):
        self.tools = tools
        self.parser = getattr(tokenizer, "tool_parser", None)
        self.start = getattr(tokenizer, "tool_call_start", None) or ""
        self.end = getattr(tokenizer, "tool_call_end", None) or ""
        if not getattr(tokenizer, "has_tool_calling", False):
            self.parser = None
        initial = "normal"
        if getattr(tokenizer, "has_thinking", False):
            if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
                initial = "reasoning"
        initial = getattr(tokenizer, "response_initial_state", None) or initial
        self.state = make_text_state_machine(tokenizer).make_state(initial)
        self.current = initial
        self.tool_text = ""
        self.made_tool_call = False

    def push(self, text: str) -> list[Delta]:
        if not text:
            return []
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._route(segments)

    def finish(self) -> list[Delta]:
        """The rest: text held back as a possible marker, an unfinished call."""
        self.state, rest, name = TextStateMachine.flush(self.state)
        out = self._route([(name, rest)])
        if self.current == "tool":
            out += self._call()
        return out

    def _route(self, segments) -> list[Delta]:
        out = []
        for name, text in segments:
            if self.current == "tool" and name != "tool":
                out += self._call()
            self.current = name
            if name == "tool":
                self.tool_text += text
            elif name == "reasoning" and text:
                out.append(Delta("reasoning", text))
            elif name == "normal" and text:
                out.append(Delta("text", text))
            # Other states are a response format's headers: control text,
            # left out as mlx_lm.server leaves it out.
        return out

    def _call(self) -> list[Delta]:
        text, self.tool_text = self.tool_text, ""
        calls = None
        if self.parser is not None and text.strip():
            try:
                calls = _calls(self.parser(text, self.tools))
            except Exception as error:  # any parser failure: the text stands
                logger.info("unreadable tool call (%s): given back as text", error)
        if calls is None:
            return [Delta("text", self.start + text + self.end)]
        self.made_tool_call = True
        return [Delta("tool_call", call=call) for call in calls]


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def openai_tool_call(call: ToolCall, index: int | None = None) -> dict:
    """A call in OpenAI's shape (``arguments`` a JSON string), as
    ``mlx_lm.server`` answers it; ``index`` for streamed chunks."""
    out = {
        "id": call.id or new_id("call_"),
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False),
        },
    }
    if index is not None:
        out["index"] = index
    return out


def template_tool_calls(message: dict, where: str) -> list[dict] | None:
    """An assistant message's OpenAI ``tool_calls`` as chat templates take
    them: each call's ``arguments`` an object, not a JSON string (what
    ``mlx_lm.server`` does too). ValueError with a sentence if malformed."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list.")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] needs a function with a name.")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ValueError(
                    f"{where}.tool_calls[{j}].function.arguments is not valid JSON."
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments or {}}})
    return out
