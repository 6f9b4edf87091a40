"""Prompt reuse across turns and concurrent requests, for full-attention,
sliding-window and recurrent targets: snapshots where chat segments end,
``usage.prompt_tokens_details.cached_tokens``, byte-bounded LRU, and output
identical to the target's own greedy decoding."""

import http.client
import json
import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_dspark.proposers.suffix import SuffixProposer
from mlx_dspark.serving import (
    BatchEngine,
    EngineConfig,
    GenerationRequest,
    ServerSettings,
    make_server,
)
from mlx_dspark.serving.prompt_cache import CachedPrompt, PromptCache
from mlx_dspark.serving.segments import segment_ends
from mlx_dspark.targets.adapter import TargetAdapter

# One of each kind of cache: full attention, sliding window (8 tokens), and
# linear attention (a recurrent state) beside full attention.
FAMILIES = ["llama", "gemma3_text", "qwen3_next"]
# A chat template for the tiny word-level tokenizer: t28 opens the system
# prompt, t29 a user turn, t27 an assistant turn.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}t28 "
    "{% elif m['role'] == 'user' %}t29 {% else %}t27 {% endif %}"
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t27{% endif %}"
)
SYSTEM = [(5 * i + 3) % 26 for i in range(40)]


def words(tokens):
    return " ".join(f"t{t}" for t in tokens)


def plain(model, tokenizer, prompt, max_tokens):
    """The target's own greedy tokens (mlx-lm), up to end of sequence."""
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if int(t) in tokenizer.eos_token_ids:
            break
        out.append(int(t))
    return out


def make_engine(model, tokenizer, **config) -> BatchEngine:
    """An engine with suffix drafts (no drafter), always drafting."""
    engine = BatchEngine(
        model,
        tokenizer,
        None,
        EngineConfig(adaptive=False, **config),
        proposer=SuffixProposer(0),
    )
    engine.proposer.vocab_size = engine.target.vocab_size
    return engine


def results(handles):
    out = []
    for handle in handles:
        tokens = []
        while True:
            event = handle.events.get(timeout=60)
            tokens += event.tokens
            if event.finish_reason:
                out.append((tokens, event.usage))
                break
    return out


def post(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    assert response.status == 200, text
    return text


def chat(port, messages, max_tokens, stream=False):
    """(text, finish_reason, usage) of a greedy chat request."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    text = post(port, "/v1/chat/completions", body)
    if not stream:
        data = json.loads(text)
        choice = data["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], data["usage"]
    chunks = [json.loads(c[6:]) for c in text.split("\n\n") if c.startswith("data: {")]
    assert chunks[-1]["choices"] == []
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]]
    return (
        "".join(pieces),
        chunks[-2]["choices"][0]["finish_reason"],
        chunks[-1]["usage"],
    )


@pytest.fixture(scope="module", params=FAMILIES)
def target(request, family):
    model, _, path = family(request.param)
    tokenizer = load_tokenizer(path, {"chat_template": TEMPLATE})
    return request.param, model, tokenizer


def test_segment_ends_from_the_template(target):
    _, _, tokenizer = target
    messages = [
        {"role": "system", "content": words(SYSTEM)},
        {"role": "user", "content": "t1 t2"},
        {"role": "assistant", "content": "t3"},
        {"role": "user", "content": "t4"},
    ]

    def render(head):
        return tokenizer.apply_chat_template(head, tokenize=True)

    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    assert prompt == [28, *SYSTEM, 29, 1, 2, 27, 3, 29, 4, 27]
    # The system prompt with its next turn's opening, each user turn.
    n = len(SYSTEM)
    assert segment_ends(render, messages, prompt) == (n + 2, n + 4, n + 8)


def test_chat_turns_reuse_the_first_turn(target):
    """Turn two reuses turn one's prompt and answer; another conversation
    with the same system prompt reuses the snapshot kept where it ends, also
    where the cache cannot be cut back (sliding window, recurrent state).
    cached_tokens says how many; every answer is the target's own."""
    name, model, tokenizer = target
    # Prefilled 16 tokens at a time: the sliding window has moved on.
    engine = make_engine(model, tokenizer, prefill_step_size=16).start()
    settings = ServerSettings(model_name="tiny", context_length=512)
    httpd = make_server(engine, tokenizer, settings, port=0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = httpd.server_address[1]
    system = {"role": "system", "content": words(SYSTEM)}
    first = [system, {"role": "user", "content": "t1 t2 t3"}]
    try:
        answer, finish, usage = chat(port, first, 6)
        p1 = [28, *SYSTEM, 29, 1, 2, 3, 27]
        a1 = tokenizer.encode(answer)
        assert a1 == plain(model, tokenizer, p1, 6)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        second = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "t9 t8"},
        ]
        text, _, usage = chat(port, second, 6, stream=True)
        p2 = [*p1, *a1, 29, 9, 8, 27]
        assert tokenizer.encode(text) == plain(model, tokenizer, p2, 6)
        # Everything the first request's cache held: its prompt and answer,
        # but the answer's last token when it was cut at max_tokens.
        held = len(p1) + len(a1) - (finish == "length")
        assert usage["prompt_tokens_details"]["cached_tokens"] == held
        other = [system, {"role": "user", "content": "t15 t16"}]
        text, _, usage = chat(port, other, 6)
        p3 = [28, *SYSTEM, 29, 15, 16, 27]
        assert tokenizer.encode(text) == plain(model, tokenizer, p3, 6)
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(SYSTEM) + 2
        if name == "llama":  # full attention: any shared prefix, completions too
            body = {"prompt": words(p3[:-1]), "max_tokens": 2, "temperature": 0}
            usage = json.loads(post(port, "/v1/completions", body))["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == len(p3) - 2
    finally:
        httpd.shutdown()
        httpd.server_close()
        engine.stop()


def test_concurrent_requests_share_a_system_prompt(target):
    """Requests that arrive together and share a long prefix: one prefills
    it, the others wait for its snapshot and prefill only their own rest."""
    _, model, tokenizer = target
    prompts = [[28, *SYSTEM, 29, 7 + i, 1, 27] for i in range(3)]
    want = [plain(model, tokenizer, p, 8) for p in prompts]
    engine = make_engine(model, tokenizer)
    handles = [engine.submit(GenerationRequest(p, max_tokens=8)) for p in prompts]
    engine.start()
    try:
        got = results(handles)
    finally:
        engine.stop()
    assert [tokens for tokens, _ in got] == want
    shared = len(SYSTEM) + 2
    cached = [usage["prompt_tokens_details"]["cached_tokens"] for _, usage in got]
    assert cached == [0, shared, shared]
    assert engine.stats.prompt_tokens_cached == 2 * shared


def test_snapshots_restore_what_a_fresh_prefill_makes(target):
    """A snapshot restored at any length it allows continues as a fresh
    prefill of those tokens does; a recurrent one only at its own length,
    a sliding window only while the window is held."""
    name, model, _ = target
    adapter = TargetAdapter(model)
    tokens = [(3 * i + 1) % 26 for i in range(30)]
    cache = adapter.make_cache()
    adapter(mx.array([tokens[:20]]), cache)
    adapter(mx.array([tokens[20:26]]), cache)
    state = adapter.snapshot(cache)
    assert state.length == 26
    # The window (8) keeps the 7 tokens before the last update, from 13 on.
    assert state.shortest == {"llama": 0, "gemma3_text": 20, "qwen3_next": 26}[name]
    for n in sorted({state.shortest, 23, 26} - set(range(state.shortest))):
        restored = adapter.restore(state, n)
        ours, _ = adapter(mx.array([tokens[n:]]), restored)
        theirs, _ = adapter(mx.array([tokens]), adapter.make_cache())
        assert mx.allclose(ours, theirs[:, n:], atol=1e-4)
    with pytest.raises(ValueError):
        adapter.restore(state, 27)


def entry_of(adapter, tokens, split=None) -> CachedPrompt:
    """A snapshot after a prefill of ``tokens`` (in two updates, the first
    of ``split`` tokens, as a running request's cache grows)."""
    cache = adapter.make_cache()
    split = split or len(tokens)
    adapter(mx.array([tokens[:split]]), cache)
    if split < len(tokens):
        adapter(mx.array([tokens[split:]]), cache)
    return CachedPrompt(tuple(tokens), adapter.snapshot(cache), None)


def test_the_cache_keeps_what_only_it_can_serve(target):
    """A longer entry replaces the prefixes it can be cut back to as far as
    they can; an entry that cannot be cut back serves only prompts that
    extend it."""
    name, model, _ = target
    adapter = TargetAdapter(model)
    short = list(range(1, 21))
    longer = [*short, 3, 4, 5, 6, 7, 8]
    cache = PromptCache(10)
    cache.insert(entry_of(adapter, short))
    cache.insert(entry_of(adapter, longer, split=20))
    assert (tuple(short) in cache) == (name != "llama")
    reuse, _, shared = cache.lookup([*short[:15], 9, 9])
    assert shared == 15
    assert reuse == (0 if name == "qwen3_next" else 15)
    assert cache.lookup([*longer, 6])[0] == 26
    assert cache.lookup(longer)[0] == (20 if name == "qwen3_next" else 25)


def test_byte_budget_evicts_the_least_recently_used(target):
    _, model, tokenizer = target
    adapter = TargetAdapter(model)
    entries = [entry_of(adapter, [i + 1, *range(2, 30)]) for i in range(4)]
    size = entries[0].nbytes
    cache = PromptCache(10, max_bytes=int(2.5 * size))
    cache.insert(entries[0])
    cache.insert(entries[1])
    assert cache.fetch([1, *range(2, 40)])[0] == 29  # entry 0 is the most recent
    cache.insert(entries[2])
    assert entries[1].tokens not in cache
    assert entries[0].tokens in cache and entries[2].tokens in cache
    assert cache.nbytes <= 2.5 * size

    # The engine holds its cache to the same budget.
    engine = make_engine(
        model, tokenizer, prompt_cache_bytes=int(1.5 * size), max_batch=1
    )
    handles = [
        engine.submit(GenerationRequest([i + 1, *range(2, 30)], max_tokens=2))
        for i in range(3)
    ]
    engine.start()
    try:
        results(handles)
    finally:
        engine.stop()
    assert 0 < len(engine.prompt_cache) and engine.prompt_cache.nbytes <= 1.5 * size
