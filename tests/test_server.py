"""The OpenAI-compatible server: batched verification, losslessness per
request, disconnects, bad input and metrics, over real HTTP on 127.0.0.1."""

import http.client
import json
import math
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import HEADS, head_id
from test_schedint import chi2, chi2_critical, exact_joint

from mlx_dspark.generation import stream_generate
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.serving import (
    BatchEngine,
    EngineConfig,
    GenerationRequest,
    ServerSettings,
    make_server,
)
from mlx_dspark.serving.engine import DraftGate

CONTEXT = 256
PROMPTS = ["t1 t2 t3", "t7 t8", "t20 t4 t11 t9", "t0", "t13 t5 t5 t21 t2 t17"]


@pytest.fixture(scope="module")
def pair(pair_factory):
    return pair_factory(block_size=8)


@pytest.fixture(scope="module")
def expected(pair):
    """Greedy single-request ``generate`` tokens per prompt, before any server
    runs (only one thread uses MLX at a time)."""
    model, tokenizer, drafter, *_ = pair

    def tokens(prompt, max_tokens):
        responses = stream_generate(
            model, tokenizer, drafter, prompt, max_tokens=max_tokens
        )
        out = [r.token for r in responses]
        if out and out[-1] in tokenizer.eos_token_ids:
            out.pop()
        return out

    return {(p, n): tokens(p, n) for p in PROMPTS for n in (48,)}


@pytest.fixture(scope="module")
def server(pair, expected):
    model, tokenizer, drafter, *_ = pair
    # Always draft (no adaptive gate): these tests are about the speculative path.
    config = EngineConfig(max_batch=8, adaptive=False)
    engine = BatchEngine(model, tokenizer, drafter, config)
    settings = ServerSettings(model_name="tiny", context_length=CONTEXT)
    httpd = make_server(engine, tokenizer, settings, port=0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    engine.stop()


def post(server, path, body, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def get(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, response.getheader("Content-Type"), text


def events(text):
    """The JSON payloads of a server-sent event stream, checking its end."""
    chunks = [c for c in text.split("\n\n") if c.strip()]
    assert chunks[-1] == "data: [DONE]"
    return [json.loads(c[len("data: ") :]) for c in chunks[:-1]]


def completion(server, prompt, max_tokens, stream, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, text = post(server, "/v1/completions", body)
    assert status == 200, text
    if not stream:
        data = json.loads(text)
        choice = data["choices"][0]
        return choice["text"], choice["finish_reason"], data["usage"], choice
    chunks = events(text)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    finish = chunks[-2]["choices"][0]["finish_reason"]
    return "".join(c["choices"][0]["text"] for c in chunks[:-1]), finish, usage, None


def test_concurrent_requests_share_forwards_and_match_generate(pair, expected, server):
    _, tokenizer, *_ = pair
    engine = server.engine
    before = (engine.stats.target_forwards, engine.stats.request_rounds)
    jobs = [(p, 48, i % 2 == 1) for i, p in enumerate(PROMPTS)]
    jobs += [(p, 48, i % 2 == 0) for i, p in enumerate(PROMPTS)]
    results = [None] * len(jobs)

    def run(i, prompt, n, stream):
        results[i] = completion(server, prompt, n, stream, logprobs=not stream)

    threads = [
        threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (prompt, n, _), (text, finish, usage, choice) in zip(
        jobs, results, strict=True
    ):
        want = expected[(prompt, n)]
        assert text == tokenizer.decode(want), prompt
        if choice is not None:
            assert [t["id"] for t in choice["logprobs"]["content"]] == want
            assert all(t["logprob"] <= 0 for t in choice["logprobs"]["content"])
        assert usage["completion_tokens"] == len(want)
        assert finish == ("length" if len(want) == n else "stop")
        dspark = usage["dspark"]
        assert dspark["rounds"] >= 1 and dspark["accepted_drafts"] > 0
    forwards = engine.stats.target_forwards - before[0]
    rounds = engine.stats.request_rounds - before[1]
    # More than one request verified per target forward, on average.
    assert rounds > 1.5 * forwards, (rounds, forwards)
    assert engine.stats.max_batch >= 3
    assert max(r[2]["dspark"]["mean_batch_size"] for r in results) > 1.5


def test_chat_streaming_and_stop(pair, expected, server):
    _, tokenizer, *_ = pair
    prompt = PROMPTS[0]
    want = tokenizer.decode(expected[(prompt, 48)])
    text, finish, usage, _ = completion(server, prompt, 48, stream=True)
    assert text == want and usage["completion_tokens"] == 48
    stop = want.split()[5]
    cut = want[: want.index(stop)]
    cancelled = server.engine.stats.cancelled
    for stream in (False, True):
        text, finish, usage, _ = completion(server, prompt, 48, stream, stop=[stop])
        assert (text, finish) == (cut, "stop")
        assert usage["completion_tokens"] < 48 and usage["dspark"]["rounds"] > 0
    assert wait_for(lambda: server.engine.stats.active == 0)
    assert server.engine.stats.cancelled == cancelled  # a stop is a finish
    body = {
        "messages": [{"role": "user", "content": "t1 t2"}],
        "max_tokens": 12,
        "temperature": 0.7,
        "seed": 3,
    }
    status, text = post(server, "/v1/chat/completions", body)
    assert status == 200, text
    data = json.loads(text)
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert data["usage"]["completion_tokens"] <= 12
    xtc = {"prompt": "t3", "temperature": 1.0, "xtc_probability": 0.5, "seed": 1}
    assert post(server, "/v1/completions", {**xtc, "max_tokens": 6})[0] == 200
    status, text = post(server, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    chunks = events(text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def wait_for(condition, seconds=20.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_disconnect_frees_the_slot(server):
    engine = server.engine
    assert wait_for(lambda: engine.stats.active == 0)
    cancelled, before = engine.stats.cancelled, engine.stats.generated_tokens
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]))
    body = json.dumps(
        {"prompt": PROMPTS[1], "max_tokens": CONTEXT - 3, "stream": True}
    ).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    assert wait_for(lambda: engine.stats.cancelled == cancelled + 1)
    assert engine.stats.active == 0
    generated = engine.stats.generated_tokens
    time.sleep(0.2)
    assert engine.stats.generated_tokens == generated  # nothing decodes for it
    assert generated - before < CONTEXT - 3  # it left before max_tokens
    # Still serving.
    text, finish, usage, _ = completion(server, PROMPTS[3], 5, stream=False)
    assert usage["completion_tokens"] == 5 and finish == "length"


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        {"prompt": "t1", "max_tokens": 0},
        {"prompt": "t1", "max_tokens": "5"},
        {"prompt": "t1", "max_tokens": True},
        {"prompt": "t1", "temperature": -0.5},
        {"prompt": "t1", "top_p": 2},
        {"prompt": "t1", "top_k": 1.5},
        {"prompt": "t1", "stream": "yes"},
        {"prompt": "t1", "stop": 5},
        {"prompt": "t1", "seed": "x"},
        {"prompt": "t1", "n": 2},
        {"prompt": "t1", "xtc_probability": 2.0},
        {"prompt": "t1", "repetition_penalty": 1.3},
        {"prompt": "t1", "logit_bias": {"3": 5}},
        {"prompt": 12},
        {"prompt": ""},
        {"prompt": [1, 2, 999]},
        {"prompt": " ".join(["t1"] * CONTEXT)},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
    ],
)
def test_bad_requests_get_400(server, body):
    if isinstance(body, bytes):
        status, text = post(server, "/v1/completions", None, raw=body)
    else:
        chat = "messages" in body
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, text = post(server, path, body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_endpoints_and_metrics(server):
    status, kind, text = get(server, "/health")
    assert (status, json.loads(text)) == (200, {"status": "ok"})
    status, _, text = get(server, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"
    assert post(server, "/v1/nothing", {})[0] == 404
    completion(server, PROMPTS[2], 8, stream=False)
    status, kind, text = get(server, "/metrics")
    assert status == 200 and kind.startswith("text/plain")
    sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+", line), line
            continue
        match = sample.match(line)
        assert match, line
        values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    for name in (
        "dspark_draft_acceptance_rate",
        "dspark_scheduler_n_current",
        "dspark_verification_latency_ms_count",
        "dspark_memory_pressure_level",
        "dspark_memory_active_bytes",
        "dspark_server_target_forwards_total",
    ):
        assert name in values, name
    assert 0 < values["dspark_draft_acceptance_rate"] <= 1
    # Nothing unmeasured reads NaN; MLX's active memory is counted on every
    # backend; this server always drafts (no gate), so it has no speedup figure,
    # and its pair has no calibration, so no ECE.
    assert "dspark_confidence_head_ece" not in values
    assert all(math.isfinite(value) for value in values.values()), values
    assert values["dspark_memory_active_bytes"] > 0
    assert "dspark_speedup_ratio" not in values
    assert (
        values["dspark_server_request_rounds_total"]
        >= values["dspark_server_target_forwards_total"]
    )


def test_an_unknown_model_is_404_model_not_found(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "model": "gpt-17-ultra"}
    status, text = post(server, "/v1/completions", body)
    assert status == 404, text
    error = json.loads(text)["error"]
    assert error["code"] == "model_not_found" and "gpt-17-ultra" in error["message"]
    chat = {"messages": [{"role": "user", "content": "t1"}], "model": "gpt-17-ultra"}
    assert post(server, "/v1/chat/completions", chat)[0] == 404
    for name in ("tiny", "default_model"):
        status, text = post(server, "/v1/completions", {**body, "model": name})
        assert status == 200 and json.loads(text)["model"] == name, text


def test_the_wrong_method_is_405(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request("GET", "/v1/chat/completions")
    response = conn.getresponse()
    assert response.status == 405 and response.getheader("Allow") == "POST"
    assert json.loads(response.read())["error"]["message"]
    conn.close()
    status, _ = post(server, "/v1/models", {})
    assert status == 405
    assert get(server, "/v1/nothing")[0] == 404


def test_gate_speedup_is_drafting_over_plain():
    gate = DraftGate()
    assert gate.speedup(1) is None
    gate.record(1, tokens=3, seconds=1.0, drafted=True)
    gate.record(1, tokens=2, seconds=1.0, drafted=False)
    assert gate.speedup(1) == pytest.approx(1.5) and gate.speedup(4) == gate.speedup(1)


@pytest.mark.parametrize("sampling", ["coupled", "residual"])
def test_sampled_requests_exact_in_mixed_batches(pair_factory, sampling):
    """Sampled requests batched with greedy ones and with each other are exact
    samples of the target (chi-square over the first tokens' joint), with
    either sampling rule."""
    model, tokenizer, drafter, *_ = pair_factory(block_size=4, sharpness=0.5, seed=3)
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt, depth, n = [1, 2, 3], 2, 600
    exact = exact_joint(model, prompt, params, depth)
    config = EngineConfig(max_batch=8, adaptive=False, sampling=sampling)
    engine = BatchEngine(model, tokenizer, drafter, config)
    try:
        handles = []
        for seed in range(n):
            handles.append(
                engine.submit(GenerationRequest(prompt, params, depth + 4, seed))
            )
            if seed % 4 == 0:  # a greedy request in the same batches
                handles.append(engine.submit(GenerationRequest([5, 6], max_tokens=6)))
        engine.start()
        counts = {}
        for handle in handles:
            tokens = []
            while True:
                event = handle.events.get(timeout=60)
                tokens += event.tokens
                if event.finish_reason:
                    break
            if handle.request.params.greedy:
                continue
            key = tuple(tokens[:depth])
            counts[key] = counts.get(key, 0) + 1
    finally:
        engine.stop()
    assert engine.stats.mean_batch > 4
    assert len(engine.telemetry.length_counts) >= 2  # Algorithm 1 decided
    assert engine.stats.drafts_accepted > 0
    assert chi2(counts, exact, n) < chi2_critical(len(exact) - 1)


@pytest.mark.parametrize(
    "args, code, out",
    [
        (["--help"], 0, "--draft-model"),
        (
            ["--model", "x"],
            1,
            "error: --model needs a DSpark --draft-model (or --dspark-suffix",
        ),
        (
            ["--prompt-cache-bytes", "lots"],
            1,
            "error: --prompt-cache-bytes must be a size such as 500M or 2G, "
            "got 'lots'.",
        ),
        (
            ["--prompt-cache-size", "-1"],
            1,
            "error: --prompt-cache-size must be at least 0, got -1.",
        ),
        (
            ["--dspark-sampling", "exact"],
            1,
            "error: --dspark-sampling must be coupled or residual, got 'exact'.",
        ),
    ],
)
def test_module_entry_point(args, code, out):
    result = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.server", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == code, result.stderr
    assert out in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def run_engine(engine, prompts, max_tokens):
    """Submit every prompt at once; the tokens of each."""
    handles = [
        engine.submit(GenerationRequest(p, max_tokens=max_tokens)) for p in prompts
    ]
    return collect(handles)


def collect(handles):
    out = []
    for handle in handles:
        tokens = []
        while True:
            event = handle.events.get(timeout=60)
            tokens += event.tokens
            if event.finish_reason:
                break
        out.append(tokens)
    return out


@pytest.mark.parametrize("mode", ["plain", "memory-critical", "chunked-prefill"])
def test_plain_batches_memory_guard_chunked_prefill(pair, expected, mode):
    """``num_draft=0`` decodes plain batches (the DSpark-off baseline); under
    critical memory pressure the guard lowers every cap to n_min instead of
    failing requests; prompts prefilled a chunk at a time between decode
    steps. All stay identical to ``generate``."""
    from mlx_dspark.policy.memory import PressureLevel
    from mlx_dspark.policy.scheduler import SchedulerSettings

    model, tokenizer, drafter, *_ = pair
    config = EngineConfig(adaptive=mode == "chunked-prefill")
    if mode == "plain":
        config.num_draft = 0
    if mode == "chunked-prefill":
        config.prefill_step_size = 2
    source = None
    if mode == "memory-critical":
        config.settings = SchedulerSettings(n_draft_min=2, interval_ms=1e-6)
        source = lambda: PressureLevel.CRITICAL  # noqa: E731
    engine = BatchEngine(model, tokenizer, drafter, config, memory_source=source)
    engine.start()
    try:
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        got = run_engine(engine, prompts, 48)
    finally:
        engine.stop()
    assert got == [expected[(p, 48)] for p in PROMPTS]
    assert engine.stats.mean_batch > 1.5
    if mode == "plain":
        assert engine.stats.drafts_verified == 0
    elif mode == "memory-critical":
        assert engine.telemetry.n_current == 2
        assert engine.telemetry.memory_pressure_level == 2
        assert max(engine.telemetry.length_counts) <= 2
        assert engine.stats.drafts_accepted > 0


def test_prompts_that_join_together_prefill_together(pair, expected):
    """Requests waiting when the engine starts prefill in shared forwards
    (prompts of different lengths, padded and masked), and still give what
    ``generate`` gives each alone."""
    model, tokenizer, drafter, *_ = pair
    engine = BatchEngine(model, tokenizer, drafter, EngineConfig())
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    handles = [engine.submit(GenerationRequest(p, max_tokens=48)) for p in prompts]
    engine.start()
    try:
        got = collect(handles)
    finally:
        engine.stop()
    assert got == [expected[(p, 48)] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1
    assert engine.stats.prefill_forwards < len(prompts)


def test_prompt_cache_reuses_prefixes_and_stays_lossless(pair, expected):
    """A prompt seen before prefills only its last token, one that extends it
    only its new tokens, from the same keys, values and drafter features a
    fresh prefill makes; outputs stay those of ``generate``; at most
    ``prompt_cache_size`` prompts are kept."""
    import mlx.core as mx

    from mlx_dspark.serving.engine import RequestHandle

    model, tokenizer, drafter, *_ = pair
    base = tokenizer.encode(PROMPTS[2])
    longer = tokenizer.encode(PROMPTS[2] + " t5 t6")
    assert longer[: len(base)] == base and len(longer) > len(base)
    want_longer = [
        r.token
        for r in stream_generate(model, tokenizer, drafter, longer, max_tokens=48)
    ]
    if want_longer[-1] in tokenizer.eos_token_ids:
        want_longer.pop()
    engine = BatchEngine(
        model, tokenizer, drafter, EngineConfig(adaptive=False, prompt_cache_size=2)
    )
    engine.start()
    cached = []
    try:
        for prompt in (base, base, longer):
            before = engine.stats.prompt_tokens_cached
            handle = engine.submit(GenerationRequest(prompt, max_tokens=48))
            tokens, usage = [], None
            while usage is None:
                event = handle.events.get(timeout=60)
                tokens += event.tokens
                usage = event.usage
            cached.append(engine.stats.prompt_tokens_cached - before)
            assert usage["prompt_tokens_details"]["cached_tokens"] == cached[-1]
            want = want_longer if prompt is longer else expected[(PROMPTS[2], 48)]
            assert tokens == want
        for other in PROMPTS[:2]:
            run_engine(engine, [tokenizer.encode(other)], 4)
    finally:
        engine.stop()
    assert cached == [0, len(base) - 1, len(base)]
    assert engine.stats.drafts_accepted > 0
    assert len(engine.prompt_cache) == 2

    extended = tokenizer.encode(PROMPTS[1] + " t9 t10")  # PROMPTS[1] is cached
    engine._admit(RequestHandle(GenerationRequest(extended, max_tokens=4)))
    slot = engine._prefilling[-1]
    reused = slot.prefilled
    assert reused == len(tokenizer.encode(PROMPTS[1])) > 0
    fresh = engine.target.make_cache()
    _, features = engine.target.hidden(mx.array([extended[:reused]]), fresh)
    assert mx.allclose(slot.unseen[0], features, atol=1e-5)
    for mine, theirs in zip(slot.cache, fresh, strict=True):
        assert mine.offset == theirs.offset == reused
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert mx.allclose(a[..., :reused, :], b[..., :reused, :], atol=1e-5)


def test_prompt_cache_keeps_the_answer_for_the_next_turn(pair):
    """A finished request leaves its prompt and answer in the cache: a next
    prompt that repeats both (a chat's next turn) prefills only what is new,
    from the keys, values and features a fresh prefill makes, and its output
    stays that of ``generate``."""
    import mlx.core as mx

    model, tokenizer, drafter, *_ = pair
    first = tokenizer.encode(PROMPTS[4])
    engine = BatchEngine(
        model, tokenizer, drafter, EngineConfig(adaptive=False, prompt_cache_size=4)
    )
    engine.start()
    try:
        # Beside shorter prompts: rows of the batch are left-padded.
        others = [tokenizer.encode(p) for p in PROMPTS[1:3]]
        answer, *_ = run_engine(engine, [first, *others], 12)
        assert answer[-1] not in tokenizer.eos_token_ids
        turn = [*first, *answer, *tokenizer.encode(PROMPTS[0])]
        want = [
            r.token
            for r in stream_generate(model, tokenizer, drafter, turn, max_tokens=24)
        ]
        if want[-1] in tokenizer.eos_token_ids:
            want.pop()
        before = engine.stats.prompt_tokens_cached
        (tokens,) = run_engine(engine, [turn], 24)
        reused = engine.stats.prompt_tokens_cached - before
    finally:
        engine.stop()
    assert tokens == want
    assert engine.stats.drafts_accepted > 0
    # Everything the first request's cache held: its prompt and every answer
    # token but the last (which no forward has seen yet).
    assert len(first) + len(answer) - 1 <= reused < len(turn)
    # An entry that another extends is dropped: the prompts', and the first
    # conversation's (the second turn's extends it).
    assert sorted(len(t) for t in engine.prompt_cache._entries) == sorted(
        [len(turn) + len(tokens) - 1, *(len(p) + 11 for p in others)]
    )

    # Each entry (prompt and answer) holds what a fresh prefill of its tokens
    # makes, the answer's drafted and verified tokens included.
    for entry in engine.prompt_cache._entries.values():
        fresh = engine.target.make_cache()
        _, features = engine.target.hidden(mx.array([entry.tokens]), fresh)
        assert entry.features.shape == features.shape
        assert mx.allclose(entry.features, features, atol=1e-4)
        for layer, theirs in zip(entry.state.layers, fresh, strict=True):
            keys, values = layer.keys, layer.values
            assert keys.shape[2] == theirs.offset == len(entry.tokens)
            assert mx.allclose(keys, theirs.keys[..., : theirs.offset, :], atol=1e-4)
            assert mx.allclose(
                values, theirs.values[..., : theirs.offset, :], atol=1e-4
            )


def test_prefill_groups():
    """Chunks share a forward while padding to the longest stays within 1.5
    times the real tokens."""
    from mlx_dspark.serving.engine import prefill_groups

    groups = prefill_groups([("a", 50), ("b", 300), ("c", 45), ("d", 5), ("e", 60)])
    assert [[name for name, _ in g] for g in groups] == [["b"], ["e", "a", "c", "d"]]
    for group in groups:
        longest = max(n for _, n in group)
        assert len(group) * longest <= 1.5 * sum(n for _, n in group)
    assert prefill_groups([]) == []
    assert prefill_groups([("a", 7)]) == [[("a", 7)]]


def test_step_cost_curve():
    """The scheduler's cost curve: a prior profile scaled to the measured step
    times, measured sizes taking over, and flat beyond the measurements."""
    from mlx_dspark.policy.scheduler import StepRateCurve
    from mlx_dspark.serving.engine import StepCost

    assert StepCost().curve().step_seconds(4) > StepCost().curve().step_seconds(1)
    prior = StepRateCurve.linear(1.0, 0.5, b_max=8, draft_seconds=0.2)
    cost = StepCost(prior)
    assert cost.curve().step_seconds(3) == pytest.approx(2.5)
    cost.record_verify(3, 0.25)  # ten times faster than the prior says
    assert cost.curve().step_seconds(3) == pytest.approx(0.25)
    assert cost.curve().step_seconds(5) == pytest.approx(0.35)
    cost.record_draft(0.01)
    assert cost.curve().draft_seconds == pytest.approx(0.3 * 0.01 + 0.7 * 0.2)
    alone = StepCost()
    alone.record_verify(2, 0.1)
    alone.record_verify(6, 0.1)
    assert alone.curve().step_seconds(20) == pytest.approx(0.1)


def test_step_cost_keeps_one_request_s_steps_for_the_profile():
    from mlx_dspark.serving.engine import StepCost

    cost = StepCost()
    for seconds in (0.01, 0.03, 0.02):
        cost.record_verify(3, seconds)
        cost.record_verify(6, 0.5, requests=2)  # two requests' rows: not the profile's
        cost.record_draft(0.004)
    measured = cost.take_measured()
    assert measured.verify == {3: (0.02, 3)} and measured.draft == (0.004, 3)
    assert not cost.take_measured()


def test_the_engine_writes_its_costs_back(pair, tmp_path, monkeypatch):
    """A finished request merges the engine's measured steps into the cached
    profile it started from (at most once every ``save_costs_every``
    seconds); an engine without one writes nothing."""
    from mlx_dspark.policy.profile import load_profile, profile_key, profile_path
    from mlx_dspark.policy.scheduler import StepRateCurve

    model, tokenizer, drafter, *_ = pair
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    key = profile_key(model, drafter)
    path = profile_path(key)
    path.parent.mkdir(parents=True)
    prior = StepRateCurve.linear(0.01, 0.001, 9, draft_seconds=0.002)
    prior.meta["key"] = key
    prior.save(path)
    prompt = tokenizer.encode(PROMPTS[0])
    for config, runs in (
        (EngineConfig(adaptive=False), None),  # --dspark-profile none
        (EngineConfig(adaptive=False, prior=load_profile(model, drafter)), 1),
    ):
        engine = BatchEngine(model, tokenizer, drafter, config).start()
        try:
            run_engine(engine, [prompt], 32)
            run_engine(engine, [prompt], 32)  # within save_costs_every
        finally:
            engine.stop()
        assert json.loads(path.read_text())["meta"].get("runs") == runs


@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_batched_drafting_every_head(pair_factory, head):
    """The drafter backbone batched over requests (padded context, per-row
    positions) equals each request's own pass, and batched greedy drafting
    keeps every head's output identical to ``generate``."""
    import mlx.core as mx

    from mlx_dspark.targets.adapter import TargetAdapter

    model, tokenizer, drafter, *_ = pair_factory(markov_head_type=head, block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompts = [[1, 2, 3], [20, 4, 11, 9, 7, 7, 1], [5]]
    alone, together, contexts, starts = [], [], [], []
    for prompt in prompts:
        _, features = target(mx.array([prompt]), target.make_cache())
        alone.append(drafter.make_cache())
        together.append(drafter.make_cache())
        contexts.append(features)
        starts.append(len(prompt))
    for step in range(2):  # the second step extends caches of unequal lengths
        anchors = mx.array([7 + step, 3, 11])
        blocks = drafter.block_tokens(anchors)
        batched = drafter.forward_batch(blocks, starts, contexts, together)
        for r in range(len(prompts)):
            single = drafter(blocks[r : r + 1], starts[r], contexts[r], alone[r])
            assert mx.allclose(single[0], batched[r], atol=1e-5).item()
        contexts = [contexts[0][:, :2]] * len(prompts)
        starts = [s + 2 for s in starts]
    want = [
        [r.token for r in stream_generate(model, tokenizer, drafter, p, max_tokens=24)]
        for p in prompts
    ]
    want = [w[:-1] if w[-1] in tokenizer.eos_token_ids else w for w in want]
    engine = BatchEngine(model, tokenizer, drafter, EngineConfig(adaptive=False))
    for p in prompts:  # more requests in the same batches
        engine.submit(GenerationRequest(p, max_tokens=24))
    handles = [engine.submit(GenerationRequest(p, max_tokens=24)) for p in prompts]
    engine.start()
    try:
        got = []
        for handle in handles:
            tokens = []
            while True:
                event = handle.events.get(timeout=60)
                tokens += event.tokens
                if event.finish_reason:
                    break
            got.append(tokens)
    finally:
        engine.stop()
    assert got == want
    assert engine.stats.mean_batch > 2


def test_monotone_cost():
    from mlx_dspark.serving.engine import StepCost, monotone

    assert monotone([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([1.0, 3.0, 2.0], [1, 1, 3]) == [1.0, 2.25, 2.25]
    cost = StepCost()
    for size, seconds in ((2, 0.2), (4, 0.5), (6, 0.3), (8, 0.6)):
        cost.record_verify(size, seconds)
    curve = cost.curve()
    times = [curve.step_seconds(b) for b in range(1, 12)]
    assert times == sorted(times)  # noise never makes a larger forward cheaper


def test_draft_gate():
    """Steps draft only when drafting was measured faster for that many
    requests (or the nearest size measured), probe the other way, and follow
    the measurements."""
    from mlx_dspark.serving.engine import DraftGate

    def steps(gate, n, requests, tokens, seconds):
        """n steps decided by the gate: drafting ones commit ``tokens`` in
        ``seconds``, plain ones ``requests`` tokens in 0.5 s. Returns how
        many drafted."""
        drafted = 0
        for _ in range(n):
            draft = gate.should_draft(requests)
            drafted += draft
            if draft:
                gate.record(requests, tokens, seconds, drafted=True)
            else:
                gate.record(requests, requests, 0.5, drafted=False)
        return drafted

    gate = DraftGate(probe_every=3)
    assert gate.should_draft(4)  # nothing measured yet
    gate.record(4, tokens=5, seconds=1.5, drafted=True)
    assert not gate.should_draft(4)  # a plain step of 4 is not timed yet
    gate.record(4, tokens=4, seconds=0.5, drafted=False)
    # Drafting: 5 tokens in 1.5 s; plain: 4 tokens in 0.5 s.
    assert not gate.should_draft(4)
    assert not gate.should_draft(2)  # a size not measured follows the nearest
    # Plain steps, and a probe after every wait; a losing probe doubles it.
    assert steps(gate, 3, 4, 4, 1.0) == 1 and gate.wait == 6
    assert steps(gate, 7, 4, 4, 1.0) == 1 and gate.wait == 12
    # Drafting becomes faster: the next probe wins, and drafting takes over,
    # with plain probes that lose further and further apart.
    assert steps(gate, 30, 4, 24, 1.5) >= 10
    assert gate.rate(4, True) > gate.rate(4, False)
    assert steps(gate, 12, 4, 24, 1.5) >= 11 and gate.wait >= 6
    # While it drafts, plain steps are probed too, so a slow plain
    # measurement cannot keep drafting on after it stops paying.
    gate.measured[(4, False)] = (4.0, 5.0)
    steps(gate, 60, 4, 4, 1.5)
    assert steps(gate, 20, 4, 4, 1.5) <= 3
    gate.record(8, 8, 0.5, drafted=False)
    gate.record(8, 12, 1.5, drafted=True)  # 8 tokens/s against 16 plain
    assert not gate.should_draft(8)
    assert not gate.should_draft(7)  # nearer to 8
    assert gate.drafting_wins(5) == (gate.rate(4, True) > gate.rate(4, False))


def test_batched_context_copying_stays_lossless(pair_factory):
    """Greedy requests copy from their own contexts in one batched proposal
    (a sampled one alone) and still match ``generate``; copying lifts the
    accepted drafts on a target that repeats itself."""
    from test_copying import REPEATING_PROMPTS, with_copy_bias

    from mlx_dspark.sampling.processing import SamplingParams

    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    want = [
        [r.token for r in stream_generate(model, tokenizer, drafter, p, max_tokens=32)]
        for p in REPEATING_PROMPTS
    ]
    want = [w[:-1] if w[-1] in tokenizer.eos_token_ids else w for w in want]
    accepted = {}
    try:
        for bias in (0.0, 1e3):
            with_copy_bias(drafter, bias)
            engine = BatchEngine(
                model, tokenizer, drafter, EngineConfig(adaptive=False)
            )
            sampled = GenerationRequest(
                REPEATING_PROMPTS[0], SamplingParams(temperature=0.8), max_tokens=32
            )
            handles = [
                engine.submit(GenerationRequest(p, max_tokens=32))
                for p in REPEATING_PROMPTS
            ]
            handles.append(engine.submit(sampled))
            engine.start()
            try:
                got = collect(handles)
            finally:
                engine.stop()
            assert got[:-1] == want, bias
            assert 0 < len(got[-1]) <= 32
            accepted[bias] = engine.stats.drafts_accepted
    finally:
        with_copy_bias(drafter, 0.0)
    assert accepted[1e3] > accepted[0.0], accepted
