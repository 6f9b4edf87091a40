"""The server with suffix drafts and no drafter: one global store shared by
all requests (a request drafts from another's output), or each request's own
text (scope request); greedy output is mlx-lm's; ``dspark_suffix_*``
metrics."""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from test_server import collect, get
from tiny_families import save_family

from mlx_dspark.proposers.suffix import SuffixProposer
from mlx_dspark.proposers.suffix_store import SuffixStore
from mlx_dspark.serving import (
    BatchEngine,
    EngineConfig,
    GenerationRequest,
    ServerSettings,
    make_server,
)

PROMPTS = [[5, 7, 1, 2, 9, 3, 4, 0, 2, 11, 6], [9, 3, 4, 0, 2], [1, 1, 2, 3, 5, 8]]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("suffix-server") / "qwen3"
    save_family(path, "qwen3")
    model, tokenizer = mlx_lm_load(str(path))
    return model, tokenizer, path


def plain(model, tokenizer, prompt):
    """mlx-lm's greedy tokens, up to end of sequence (left out)."""
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        if int(t) in tokenizer.eos_token_ids:
            break
        out.append(int(t))
    return out


def engine_for(model, tokenizer, scope: str) -> BatchEngine:
    store = SuffixStore() if scope == "global" else None
    engine = BatchEngine(
        model,
        tokenizer,
        None,
        EngineConfig(max_batch=8, adaptive=False),
        proposer=SuffixProposer(0, store=store),
    )
    engine.proposer.vocab_size = engine.target.vocab_size
    return engine.start()


def ask(engine, prompt):
    """A request's tokens and usage."""
    handle = engine.submit(GenerationRequest(prompt, max_tokens=MAX_TOKENS))
    tokens = []
    while True:
        event = handle.events.get(timeout=120)
        tokens += event.tokens
        if event.finish_reason:
            return tokens, event.usage


@pytest.mark.parametrize("scope", ["global", "request"])
def test_a_request_drafts_from_another_requests_output(target, scope):
    model, tokenizer, _ = target
    engine = engine_for(model, tokenizer, scope)
    try:
        # Concurrent requests: each one's greedy output is mlx-lm's.
        handles = [
            engine.submit(GenerationRequest(p, max_tokens=MAX_TOKENS)) for p in PROMPTS
        ]
        expected = [plain(model, tokenizer, p) for p in PROMPTS]
        assert collect(handles) == expected
        # One after another: the second request's answer repeats the first's,
        # which its own text (the prompt) does not hold, the store does.
        first, used = ask(engine, PROMPTS[0])
        assert first == expected[0]
        second, usage = ask(engine, PROMPTS[0])
        assert second == expected[0]
        mine = usage["dspark"]
        if scope == "global":
            assert mine["suffix_global_rounds"] > 0
            assert mine["suffix_global_accepted"] > 0
            # The same request alone with the store's help commits more per
            # round than the first time, which had only other prompts' text.
            assert engine.stats.suffix_global_rounds >= mine["suffix_global_rounds"]
            assert engine.stats.suffix_store_documents == len(PROMPTS) + 2
            assert not engine.proposer.store._live  # every document closed
        else:
            assert mine["suffix_global_rounds"] == 0
            assert engine.stats.suffix_global_rounds == 0
        assert mine["suffix_rounds"] > 0 and used["dspark"]["suffix_rounds"] > 0
    finally:
        engine.stop()


def test_a_request_drafts_from_an_answer_still_being_written(target):
    """A long request's answer is in the global store while it is written: a
    short request with the same prompt, started once the long one is ahead
    and finished before it, drafts from that live answer."""
    model, tokenizer, _ = target
    prompt = PROMPTS[0]
    long_tokens = 3 * MAX_TOKENS
    expected = plain(model, tokenizer, prompt)
    engine = engine_for(model, tokenizer, "global")
    try:
        first = engine.submit(GenerationRequest(prompt, max_tokens=long_tokens))
        written = []
        while len(written) < 12:
            event = first.events.get(timeout=120)
            written += event.tokens
            assert not event.finish_reason
        second, usage = ask(engine, prompt)
        assert second == expected
        assert engine.stats.suffix_store_documents == 2
        assert list(engine.proposer.store._live)  # the long answer: still open
        assert usage["dspark"]["suffix_global_rounds"] > 0
        assert usage["dspark"]["suffix_global_accepted"] > 0
        assert collect([first])[0]
    finally:
        engine.stop()


def test_metrics_name_the_suffix_rounds(target):
    model, tokenizer, _ = target
    engine = engine_for(model, tokenizer, "global")
    settings = ServerSettings(model_name="tiny", context_length=256)
    httpd = make_server(engine, tokenizer, settings, port=0)
    import threading

    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        ask(engine, PROMPTS[0])
        ask(engine, PROMPTS[0])
        status, _, text = get(httpd, "/metrics")
        assert status == 200
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("dspark_suffix_")
        }
        assert values["dspark_suffix_rounds_total"] > 0
        assert values["dspark_suffix_accepted_tokens_total"] > 0
        assert values["dspark_suffix_global_rounds_total"] > 0
        assert values["dspark_suffix_global_accepted_tokens_total"] > 0
        assert values["dspark_suffix_store_documents"] == 2
        assert values["dspark_suffix_store_tokens"] > 0
    finally:
        httpd.shutdown()
        httpd.server_close()
        engine.stop()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dspark-suffix-scope", "everyone"], "--dspark-suffix-scope must be"),
        (
            ["--dspark-suffix-scope", "request", "--dspark-suffix-store", "auto"],
            "needs --dspark-suffix-scope global",
        ),
        (["--draft-model", "x"], "cannot be combined with a drafter yet"),
    ],
)
def test_server_suffix_flags_refused_in_one_sentence(target, extra, message):
    _, _, path = target
    result = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.server", "--model", str(path)]
        + ["--dspark-suffix", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
