"""The server as agents use it, driven by the official ``anthropic`` and
``openai`` SDKs over real HTTP: Anthropic's Messages API (streamed and not,
count_tokens, errors in Anthropic's shape, stop sequences, disconnects) with
the same lossless output as ``mlx_dspark.generate`` and the chat route, and
tool calls parsed by mlx-lm's own parsers (json_tools with thinking,
qwen3_coder, mistral) from a tiny model steered to emit them."""

import http.client
import json
import socket
import threading
import time

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_dspark.generation import stream_generate
from mlx_dspark.pairs.structured import (
    PairSpec,
    _codes,
    _save,
    _target_weights,
    target_config,
)
from mlx_dspark.proposers.suffix import SuffixProposer
from mlx_dspark.proposers.suffix_store import SuffixStore
from mlx_dspark.serving import BatchEngine, EngineConfig, ServerSettings, make_server
from mlx_dspark.serving import anthropic as messages_api
from mlx_dspark.serving.api import chat_prompt
from mlx_dspark.serving.tool_calls import ChatOutput

CONTEXT = 256
SYSTEM = "t4 t5 t6"
QUESTIONS = ["t1 t2 t3", "t7 t8", "t20 t4 t11 t9", "t13 t5 t5 t21 t2 t17"]


def serve(engine, tokenizer, name):
    settings = ServerSettings(model_name=name, context_length=CONTEXT)
    httpd = make_server(engine, tokenizer, settings, port=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def clients(httpd):
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    return (
        anthropic.Anthropic(
            base_url=url,
            api_key="any",
            max_retries=0,
            default_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
        ),
        openai.OpenAI(base_url=url + "/v1", api_key="any", max_retries=0),
    )


# -- text: a structured DSpark pair ------------------------------------------


@pytest.fixture(scope="module")
def pair(pair_factory):
    return pair_factory(block_size=8)


def chat_ids(tokenizer, question, system=SYSTEM):
    messages = [{"role": "user", "content": question}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return chat_prompt(tokenizer, {"messages": messages}, {})


@pytest.fixture(scope="module")
def expected(pair):
    """Prompt ids and greedy ``generate`` tokens per question, alone, before
    any server runs."""
    model, tokenizer, drafter, *_ = pair
    out = {}
    for question in QUESTIONS:
        ids = chat_ids(tokenizer, question)
        tokens = [
            r.token
            for r in stream_generate(model, tokenizer, drafter, ids, max_tokens=40)
        ]
        if tokens and tokens[-1] in tokenizer.eos_token_ids:
            tokens.pop()
        out[question] = (ids, tokens)
    return out


@pytest.fixture(scope="module")
def server(pair, expected):
    model, tokenizer, drafter, *_ = pair
    engine = BatchEngine(
        model, tokenizer, drafter, EngineConfig(max_batch=8, adaptive=False)
    )
    httpd = serve(engine, tokenizer, "tiny")
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    engine.stop()


def ask(client, question, stream=False, **extra):
    """The Messages answer (a final Message also when streamed)."""
    body = {
        "model": "tiny",
        "max_tokens": 40,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": question}],
        **extra,
    }
    if not stream:
        return client.messages.create(**body)
    with client.messages.stream(**body) as events:
        return events.get_final_message()


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def test_messages_equal_generate_and_chat_completions(pair, expected, server):
    _, tokenizer, *_ = pair
    claude, gpt = clients(server)
    question = QUESTIONS[0]
    ids, tokens = expected[question]
    want = tokenizer.decode(tokens)
    cached = []
    for stream in (False, True):
        message = ask(claude, question, stream, metadata={"user_id": "u1"})
        cached.append(message.usage.cache_read_input_tokens)
        assert message.id.startswith("msg_") and message.type == "message"
        assert message.role == "assistant" and message.model == "tiny"
        assert [b.type for b in message.content] == ["text"]
        assert text_of(message) == want
        assert message.stop_reason == (
            "max_tokens" if len(tokens) == 40 else "end_turn"
        )
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == len(ids)
        assert usage.cache_creation_input_tokens == 0
        assert usage.output_tokens == len(tokens)
    # The second time, the prompt comes from the prompt cache.
    assert cached[1] > 0, cached
    # The system prompt as text blocks is the same prompt.
    blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    assert text_of(ask(claude, question, system=blocks)) == want
    count = claude.messages.count_tokens(
        model="tiny", system=blocks, messages=[{"role": "user", "content": question}]
    )
    assert count.input_tokens == len(ids)
    chat = gpt.chat.completions.create(
        model="tiny",
        max_tokens=40,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
    )
    assert chat.choices[0].message.content == want
    assert chat.usage.prompt_tokens == len(ids)


def test_the_event_stream_is_anthropics(server):
    claude, _ = clients(server)
    stream = claude.messages.create(
        model="tiny",
        max_tokens=12,
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        stream=True,
    )
    events = list(stream)
    names = [e.type for e in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == 12
    # The wire format: "event: NAME" lines, a ping after message_start.
    status, text = post(server, "/v1/messages", {**_body(QUESTIONS[1]), "stream": True})
    chunks = [c.split("\n") for c in text.strip().split("\n\n")]
    assert status == 200 and all(c[0].startswith("event: ") for c in chunks)
    assert [c[0] for c in chunks[:2]] == ["event: message_start", "event: ping"]
    for lines in chunks:
        assert json.loads(lines[1][len("data: ") :])["type"] == lines[0][7:]


def test_stop_sequences(pair, expected, server):
    _, tokenizer, *_ = pair
    claude, _ = clients(server)
    question = QUESTIONS[2]
    want = tokenizer.decode(expected[question][1])
    stop = want.split()[4]
    for stream in (False, True):
        message = ask(claude, question, stream, stop_sequences=["zz", stop])
        assert message.stop_reason == "stop_sequence"
        assert message.stop_sequence == stop
        assert text_of(message) == want[: want.index(stop)]


def test_concurrent_clients_each_get_generates_output(pair, expected, server):
    _, tokenizer, *_ = pair
    engine = server.engine
    claude, gpt = clients(server)
    jobs = [(q, kind) for q in QUESTIONS for kind in ("stream", "create", "openai")]
    results = [None] * len(jobs)

    def run(i, question, kind):
        if kind == "openai":
            chat = gpt.chat.completions.create(
                model="tiny",
                max_tokens=40,
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
            )
            results[i] = chat.choices[0].message.content
        else:
            results[i] = text_of(ask(claude, question, kind == "stream"))

    before = (engine.stats.target_forwards, engine.stats.request_rounds)
    threads = [threading.Thread(target=run, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (question, _), text in zip(jobs, results, strict=True):
        assert text == tokenizer.decode(expected[question][1]), question
    forwards = engine.stats.target_forwards - before[0]
    rounds = engine.stats.request_rounds - before[1]
    assert rounds > 1.5 * forwards, (rounds, forwards)  # batched verification


def post(server, path, body, raw=None, method="POST"):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "anthropic-version": "2023-06-01"}
    conn.request(method, path, data if method == "POST" else None, headers)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def _body(question, **extra):
    return {
        "model": "tiny",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"extra_body": {"temperature": -1}}, "temperature must be >= 0.0."),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
            "output_config.format (structured outputs) is not supported: "
            "generation here is never constrained.",
        ),
        ({"max_tokens": 0}, "max_tokens must be at least 1."),
        ({"stop_sequences": "x"}, "stop_sequences must be a list of strings."),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "data": "",
                                    "media_type": "image/png",
                                },
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0]: image blocks are not supported by this "
            "server (text only).",
        ),
        (
            {"messages": [{"role": "robot", "content": "t1"}]},
            "messages[0].role must be user or assistant.",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "nope"}},
            "tool_choice names a tool that is not in tools.",
        ),
        (
            {"tools": [{"name": "web", "type": "web_search_20250305"}]},
            "tools[0] (web): only custom tools with an input_schema are supported.",
        ),
    ],
)
def test_bad_requests_raise_bad_request_error(server, extra, message):
    claude, _ = clients(server)
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(**_body(QUESTIONS[0], **extra))
    assert error.value.status_code == 400
    assert error.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message},
    }


def test_errors_are_in_anthropics_shape(server):
    claude, _ = clients(server)
    with pytest.raises(anthropic.NotFoundError) as error:
        claude.messages.create(**_body(QUESTIONS[0], model="claude-opus-9"))
    assert error.value.body["error"]["type"] == "not_found_error"
    assert "'claude-opus-9' does not exist" in error.value.body["error"]["message"]
    body = _body(QUESTIONS[0])
    del body["max_tokens"]
    status, text = post(server, "/v1/messages", body)
    assert (status, json.loads(text)) == (
        400,
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "max_tokens is required.",
            },
        },
    )
    status, text = post(server, "/v1/messages", None, raw=b"{oops")
    assert status == 400 and json.loads(text)["error"]["message"].startswith(
        "Invalid JSON"
    )
    status, text = post(server, "/v1/messages", None, method="GET")
    assert status == 405 and json.loads(text)["type"] == "error"
    # Anthropic's model list, for a client that asks with anthropic-version.
    assert [m.id for m in claude.models.list().data] == ["tiny"]


def test_a_client_leaving_mid_stream_cancels_only_its_request(pair, expected, server):
    _, tokenizer, *_ = pair
    engine = server.engine
    assert wait_for(lambda: engine.stats.active == 0)
    cancelled = engine.stats.cancelled
    claude, _ = clients(server)
    others = [None, None]

    def other(i):
        others[i] = text_of(ask(claude, QUESTIONS[3], stream=bool(i)))

    sock = socket.create_connection(("127.0.0.1", server.server_address[1]))
    body = json.dumps(
        {**_body(QUESTIONS[1]), "max_tokens": CONTEXT - 40, "stream": True}
    )
    sock.sendall(
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body.encode()
    )
    threads = [threading.Thread(target=other, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    for t in threads:
        t.join()
    assert wait_for(lambda: engine.stats.cancelled == cancelled + 1)
    assert others == [tokenizer.decode(expected[QUESTIONS[3]][1])] * 2


def wait_for(condition, seconds=20.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


# -- tool calls: a tiny model steered to call a tool ---------------------------

# A target that continues each token with a fixed successor (a qwen3 model of
# mlx-lm's class whose layers add nothing; its LM head maps token i to
# SUCCESSOR[i]). From the generation prompt's last token (id 20) it says ids
# 21..29 and then ends; each format's tokenizer gives those ids the strings of
# an answer in that format: some text, then a tool call.
VOCAB, EOS, UNK, START = 40, 38, 39, 20
PATH = list(range(START + 1, START + 10))
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
CALL = {"city": "Paris"}

JSON_TOOLS = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% for tool_call in m.tool_calls or [] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
QWEN3_CODER = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for tool_call in m.tool_calls or [] %}<tool_call>\n<function="
    "{{ tool_call.function.name }}>\n{% for k, v in tool_call.function.arguments"
    ".items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{% for tool_call in m.tool_calls or [] %}[TOOL_CALLS]"
    "{{ tool_call.function.name }}[ARGS]{{ tool_call.function.arguments | tojson }}"
    "{% endfor %}</s>{% endif %}{% endfor %}"
)
# format: (chat template, the generation prompt's last token, strings of PATH)
FORMATS = {
    "json_tools": (
        JSON_TOOLS,
        "<|im_start|>assistant\n",
        [
            "<think>",
            "\nThe user wants the weather.\n",
            "</think>",
            "I will look it up.\n",
            "<tool_call>",
            '\n{"name": "get_weather", ',
            '"arguments": {"city": "Paris"}}',
            "\n",
            "</tool_call>",
        ],
    ),
    "qwen3_coder": (
        QWEN3_CODER,
        "<|im_start|>assistant\n",
        [
            "Let me ",
            "check ",
            "the weather.",
            "\n",
            "<tool_call>",
            "\n<function=get_weather>\n",
            "<parameter=city>\nParis\n</parameter>\n",
            "</function>\n",
            "</tool_call>",
        ],
    ),
    "mistral": (
        MISTRAL,
        "[/INST]",
        [
            "Let me ",
            "check ",
            "the weather.",
            " ",
            "[TOOL_CALLS]",
            "get_weather",
            "[ARGS]",
            '{"city": ',
            '"Paris"}',
        ],
    ),
}
# What each format's answer says before its call, and thinks.
SAID = {
    "json_tools": ("I will look it up.\n", "\nThe user wants the weather.\n"),
    "qwen3_coder": ("Let me check the weather.\n", ""),
    "mistral": ("Let me check the weather. ", ""),
}


def save_tokenizer(directory, template, start, path):
    """A word-level tokenizer whose PATH ids are the given strings (added
    tokens, so they are found inside any text), decoded by concatenation."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(START)}
    for i, text in zip([START, *PATH], [start, *path], strict=True):
        vocab[text] = i
    vocab |= {f"x{i}": i for i in range(PATH[-1] + 1, EOS)}
    vocab |= {"</s>": EOS, "<unk>": UNK}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t in [start, *path]]
    )
    (directory / "tokenizer.json").write_text(tokenizer.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    """The steered model, each format's tokenizer, and a server per format
    (one engine, suffix drafts) — ``{format: (tokenizer, server)}``."""
    spec = PairSpec(
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=64,
        perturbation=0.0,
    )
    rng = np.random.default_rng(0)
    successor = dict(zip([START, *PATH], [*PATH, EOS], strict=True))
    free = [i for i in range(VOCAB) if i not in successor.values()]
    for i in range(VOCAB):
        if i not in successor:
            successor[i] = free.pop(0)
    chain = np.array([successor[i] for i in range(VOCAB)])
    weights = _target_weights(spec, _codes(spec, rng), chain, rng)
    root = tmp_path_factory.mktemp("steered")
    tokenizers = {}
    for name, (template, start, path) in FORMATS.items():
        _save(root / name, target_config(spec), weights, mx.float32)
        save_tokenizer(root / name, template, start, path)
        tokenizers[name] = load_tokenizer(root / name)
    model, _ = mlx_lm_load(str(root / "json_tools"))
    # The model's own greedy answer after the generation prompt: PATH, then
    # end of sequence.
    prompt = mx.array([UNK, 3, START])
    said = [int(t) for t, _ in generate_step(prompt, model, max_tokens=11)]
    assert said[: len(PATH) + 1] == [*PATH, EOS]
    engine = BatchEngine(
        model,
        tokenizers["json_tools"],
        None,
        EngineConfig(max_batch=8, adaptive=False),
        proposer=SuffixProposer(0, store=SuffixStore()),
    )
    engine.proposer.vocab_size = engine.target.vocab_size
    engine.start()
    servers = {name: serve(engine, t, "steered") for name, t in tokenizers.items()}
    yield {name: (tokenizers[name], servers[name]) for name in FORMATS}
    for httpd in servers.values():
        httpd.shutdown()
        httpd.server_close()
    engine.stop()


@pytest.mark.parametrize("name", list(FORMATS))
def test_mlx_lm_picks_the_format_and_parses_the_answer(steered, name):
    tokenizer, _ = steered[name]
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_parser.__module__ == f"mlx_lm.tool_parsers.{name}"
    assert tokenizer.has_thinking == (name == "json_tools")
    text = tokenizer.decode(PATH)
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    for pieces in ([text], list(text)):  # whole, and one character at a time
        output = ChatOutput(tokenizer, [START], tools)
        deltas = [d for p in pieces for d in output.push(p)] + output.finish()
        said = "".join(d.text for d in deltas if d.kind == "text")
        thought = "".join(d.text for d in deltas if d.kind == "reasoning")
        calls = [d.call for d in deltas if d.kind == "tool_call"]
        assert (said, thought) == SAID[name]
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", CALL)]
        assert deltas[-1].kind == "tool_call" and output.made_tool_call


def test_an_unreadable_tool_call_is_given_back_as_text(steered):
    tokenizer, _ = steered["json_tools"]
    output = ChatOutput(tokenizer, [START])
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"ci'
    deltas = output.push(text) + output.finish()
    assert [d.kind for d in deltas] == ["text", "text"]
    assert "".join(d.text for d in deltas) == text + "</tool_call>"
    assert not output.made_tool_call
    # A call whose end marker is missing is read at the end of the answer.
    output = ChatOutput(tokenizer, [START])
    deltas = output.push('<tool_call>{"name": "f", "arguments": {}}') + output.finish()
    assert [(d.kind, d.call.name) for d in deltas] == [("tool_call", "f")]


def openai_tools():
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in TOOLS
    ]


@pytest.mark.parametrize("name", list(FORMATS))
def test_chat_completions_answer_tool_calls(steered, name):
    _, httpd = steered[name]
    _, gpt = clients(httpd)
    said, thought = SAID[name]
    body = dict(
        model="steered",
        max_tokens=30,
        messages=[{"role": "user", "content": "weather w3 Paris"}],
        tools=openai_tools(),
    )
    chat = gpt.chat.completions.create(**body)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == said
    assert (choice.message.model_extra or {}).get("reasoning", "") == thought
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL
    assert chat.usage.completion_tokens == len(PATH)
    # Streamed: the same pieces, the call whole in one chunk.
    content, reasoning, calls, finish = "", "", [], None
    for chunk in gpt.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning", "")
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert (content, reasoning, finish) == (said, thought, "tool_calls")
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == CALL


@pytest.mark.parametrize("name", list(FORMATS))
def test_messages_answer_tool_use_blocks(steered, name):
    _, httpd = steered[name]
    claude, _ = clients(httpd)
    said, thought = SAID[name]
    body = dict(
        model="steered",
        max_tokens=30,
        messages=[{"role": "user", "content": "weather w3 Paris"}],
        tools=TOOLS,
        tool_choice={"type": "auto"},
    )
    message = claude.messages.create(**body)
    with claude.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    for answer in (message, streamed):
        kinds = ["text", "tool_use"]
        if thought:
            kinds.insert(0, "thinking")
            assert answer.content[0].thinking == thought
        assert [b.type for b in answer.content] == kinds
        assert answer.content[-2].text == said
        use = answer.content[-1]
        assert use.id.startswith("toolu_") and use.name == "get_weather"
        assert use.input == CALL
        assert answer.stop_reason == "tool_use" and answer.stop_sequence is None
        assert answer.usage.output_tokens == len(PATH)


def test_a_tool_round_trip(steered):
    """tool_use, then a tool_result turn: the prompt is the chat template's
    rendering of the OpenAI-style messages it maps to."""
    tokenizer, httpd = steered["json_tools"]
    claude, gpt = clients(httpd)
    question = {"role": "user", "content": "weather w3 Paris"}
    first = claude.messages.create(
        model="steered", max_tokens=30, messages=[question], tools=TOOLS
    )
    use = first.content[-1]
    result = {
        "type": "tool_result",
        "tool_use_id": use.id,
        "content": [{"type": "text", "text": "w5 w6 w7"}],
    }
    turn = [
        question,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [result, {"type": "text", "text": "w8"}]},
    ]
    said, thought = SAID["json_tools"]
    call = {
        "id": use.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": CALL},
    }
    mapped = [
        question,
        {
            "role": "assistant",
            "content": said,
            "tool_calls": [call],
            "reasoning_content": thought,
        },
        {
            "role": "tool",
            "tool_call_id": use.id,
            "content": "w5 w6 w7",
            "name": "get_weather",
        },
        {"role": "user", "content": "w8"},
    ]
    want = tokenizer.apply_chat_template(
        mapped, tools=openai_tools(), add_generation_prompt=True
    )
    body = messages_api.chat_body(
        {"model": "steered", "max_tokens": 30, "messages": turn, "tools": TOOLS}
    )
    assert chat_prompt(tokenizer, body, {}) == want
    second = claude.messages.create(
        model="steered", max_tokens=30, messages=turn, tools=TOOLS
    )
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == len(want)
    count = claude.messages.count_tokens(model="steered", messages=turn, tools=TOOLS)
    assert count.input_tokens == len(want)
    # The same turn through the chat route, arguments as a JSON string.
    chat = gpt.chat.completions.create(
        model="steered",
        max_tokens=30,
        tools=openai_tools(),
        messages=[
            question,
            {
                "role": "assistant",
                "content": said,
                "reasoning_content": thought,
                "tool_calls": [
                    {
                        **call,
                        "function": {
                            **call["function"],
                            "arguments": '{"city": "Paris"}',
                        },
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": use.id,
                "content": "w5 w6 w7",
                "name": "get_weather",
            },
            {"role": "user", "content": "w8"},
        ],
    )
    assert chat.usage.prompt_tokens == len(want)


def test_chat_route_refuses_unreadable_tool_call_arguments(server):
    _, gpt = clients(server)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    with pytest.raises(openai.BadRequestError) as error:
        gpt.chat.completions.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {"role": "user", "content": "t1"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "t2"},
            ],
        )
    assert error.value.body["message"] == (
        "messages[1].tool_calls[0].function.arguments is not valid JSON."
    )
