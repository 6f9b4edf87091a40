"""``seed``: sampled DSpark output is mlx-lm's own, token for token.

mlx-lm draws token i with the i-th key split from the global state after
``mx.random.seed(S)``; coupled sampling computes those keys and commits the
target's own draw at every row (:mod:`mlx_dspark.sampling.coupled`). These tests
compare with ``mlx_lm.stream_generate`` itself, on a structured pair whose
drafts are often but not always accepted.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_dspark.errors import DSparkError
from mlx_dspark.generation import generate, stream_generate
from mlx_dspark.sampling.coupled import TokenKeys, mlx_lm_token, resolve_sampling
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.serving import BatchEngine, EngineConfig, GenerationRequest

SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t0.8-minp-k": SamplingParams(
        temperature=0.8, min_p=0.05, min_tokens_to_keep=3, top_k=12
    ),
    "t1-xtc": SamplingParams(
        temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1, top_p=0.95
    ),
}
SEEDS = (0, 1, 7)
PROMPT = [3, 14, 15, 9]
MAX_TOKENS = 24


def sampler(params: SamplingParams):
    return make_sampler(
        params.temperature,
        params.top_p,
        params.min_p,
        params.min_tokens_to_keep,
        top_k=params.top_k,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=list(params.xtc_special_tokens),
    )


def kwargs(params: SamplingParams) -> dict:
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "min_tokens_to_keep": params.min_tokens_to_keep,
        "xtc_probability": params.xtc_probability,
        "xtc_threshold": params.xtc_threshold,
    }


def mlx_lm_tokens(model, tokenizer, params, seed, max_tokens=MAX_TOKENS):
    mx.random.seed(seed)
    responses = mlx_lm_stream_generate(
        model,
        tokenizer,
        mx.array(PROMPT),
        max_tokens=max_tokens,
        sampler=sampler(params),
    )
    return [r.token for r in responses]


def dspark_tokens(model, tokenizer, drafter, params, seed, **extra):
    responses = list(
        stream_generate(
            model,
            tokenizer,
            drafter,
            mx.array(PROMPT),
            max_tokens=MAX_TOKENS,
            seed=seed,
            **kwargs(params),
            **extra,
        )
    )
    return [r.token for r in responses], responses[-1].stats


@pytest.fixture(scope="module")
def pair(pair_factory):
    return pair_factory(markov_head_type="vanilla", sharpness=0.6, block_size=5)


@pytest.fixture(scope="module")
def expected(pair):
    model, tokenizer, *_ = pair
    return {
        (name, seed): mlx_lm_tokens(model, tokenizer, params, seed)
        for name, params in SETTINGS.items()
        for seed in SEEDS
    }


def test_token_keys_reproduce_mlx_lm_sampler():
    """Each setting's draws equal mlx-lm's sampler on the global state,
    XTC's coin included; other seeds give other draws."""
    rows = mx.random.normal((40, 1, 64), key=mx.random.key(5)) * 3
    for params in SETTINGS.values():
        for seed in SEEDS:
            mx.random.seed(seed)
            draw = sampler(params)
            theirs = [
                draw(row - mx.logsumexp(row, keepdims=True)).item() for row in rows
            ]
            keys = TokenKeys.from_seed(seed, params)
            ours = [mlx_lm_token(row, params, keys.take(1)[0]).item() for row in rows]
            assert ours == theirs
            other = TokenKeys.from_seed(seed + 100, params)
            assert [
                mlx_lm_token(row, params, other.take(1)[0]).item() for row in rows
            ] != theirs


def test_token_keys_peek_then_take():
    keys = TokenKeys.from_seed(3, SETTINGS["t1-xtc"])
    ahead = keys.peek(3)
    assert all(coin is not None for coin, _ in ahead)
    taken = keys.take(2)
    assert all(
        mx.array_equal(a[1], b[1]).item() for a, b in zip(ahead[:2], taken, strict=True)
    )
    assert mx.array_equal(keys.take(1)[0][1], ahead[2][1]).item()
    assert not mx.array_equal(keys.take(1)[0][1], ahead[2][1]).item()


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize(
    "policy",
    [
        {},
        {"num_draft": 0},
        {"num_draft": 1},
        {"num_draft": 3},
        {"num_draft": 5},
        {"tree_budget": 6},
        {"scheduler": "threshold", "confidence_threshold": 0.5},
        {"scheduler": "auto"},
    ],
    ids=["default", "plain", "n1", "n3", "n5", "tree", "threshold", "scheduler"],
)
def test_seeded_output_equals_mlx_lm(pair, expected, name, policy):
    model, tokenizer, drafter, *_ = pair
    params = SETTINGS[name]
    accepted, rejected = 0, 0
    for seed in SEEDS:
        tokens, stats = dspark_tokens(model, tokenizer, drafter, params, seed, **policy)
        assert tokens == expected[(name, seed)], seed
        accepted += sum(r.accepted for r in stats.rounds)
        rejected += sum(r.accepted < r.verified for r in stats.rounds)
    if policy.get("num_draft", 0) > 1:  # drafts often, not always, accepted
        assert accepted > 0 and rejected > 0


def test_seeded_generate_text_equals_mlx_lm(pair):
    from mlx_lm.generate import generate as mlx_lm_generate

    model, tokenizer, drafter, *_ = pair
    params = SETTINGS["t0.7-p0.9"]
    for seed in SEEDS:
        mx.random.seed(seed)
        theirs = mlx_lm_generate(
            model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, sampler=sampler(params)
        )
        ours = generate(
            model,
            tokenizer,
            drafter,
            PROMPT,
            max_tokens=MAX_TOKENS,
            seed=seed,
            **kwargs(params),
        )
        assert ours == theirs


def test_copy_rounds_keep_mlx_lm_output(pair, expected):
    """A drafter copying from the context (copy bias, copied drafts past the
    block and as-is copy rounds) still commits mlx-lm's tokens."""
    import dataclasses

    model, tokenizer, drafter, *_ = pair
    original = drafter.config
    drafter.config = dataclasses.replace(original, context_copy_bias=8.0)
    try:
        for seed in SEEDS:
            for extra in ({"num_draft": 4}, {}):
                tokens, _ = dspark_tokens(
                    model, tokenizer, drafter, SETTINGS["t1"], seed, **extra
                )
                assert tokens == expected[("t1", seed)]
    finally:
        drafter.config = original


def test_seeded_generation_leaves_the_global_keys_alone(pair):
    """Neither the loop nor the default policy (its cost profile and
    calibration) draws from the global key state."""
    model, tokenizer, drafter, *_ = pair
    mx.random.seed(11)
    before = np.array(mx.random.state[0])
    dspark_tokens(model, tokenizer, drafter, SETTINGS["t1"], 0, profile="refresh")
    assert np.array_equal(np.array(mx.random.state[0]), before)


def test_own_keys_and_loading_leave_the_global_keys_as_mlx_lm_does(pair):
    """``own_keys`` undoes the draws inside it; loading a pair moves the
    global key state exactly as ``mlx_lm.load`` of the target alone does
    (weight initialisation draws keys), so ``mlx_dspark.generate --seed``
    samples from mlx-lm's key state."""
    from mlx_lm.utils import load as mlx_lm_load

    from mlx_dspark.loading import load
    from mlx_dspark.sampling.coupled import own_keys

    *_, target_dir, drafter_dir, _ = pair
    mx.random.seed(4)
    with own_keys():
        mx.random.uniform(shape=(3,))
    assert mx.array_equal(mx.random.state[0], mx.random.key(4)).item()
    mx.random.seed(4)
    mlx_lm_load(str(target_dir))
    theirs = np.array(mx.random.state[0])
    assert not np.array_equal(theirs, np.array(mx.random.key(4)))
    mx.random.seed(4)
    load(target_dir, drafter_dir)
    assert np.array_equal(np.array(mx.random.state[0]), theirs)


def test_unseeded_coupled_goes_on_from_the_global_keys(pair, expected):
    """Coupled without a seed draws from the global key state like mlx-lm:
    ``mx.random.seed(S)`` first gives mlx-lm's output for S, even when the
    default policy measures its cost profile before the first token."""
    model, tokenizer, drafter, *_ = pair
    params = SETTINGS["t1-xtc"]
    for seed in SEEDS:
        mx.random.seed(seed)
        tokens, _ = dspark_tokens(
            model,
            tokenizer,
            drafter,
            params,
            None,
            sampling="coupled",
            profile="refresh",
        )
        assert tokens == expected[("t1-xtc", seed)]


def served(handle) -> list[int]:
    """A server request's tokens, to its end."""
    tokens = []
    while True:
        event = handle.events.get(timeout=120)
        assert event.error is None
        tokens += event.tokens
        if event.finish_reason:
            return tokens


def served_as(tokens, tokenizer) -> list[int]:
    """mlx-lm's tokens as the server sends them: without the end of sequence."""
    if tokens and tokens[-1] in tokenizer.eos_token_ids:
        return tokens[:-1]
    return tokens


def test_server_requests_with_a_seed_equal_mlx_lm(pair, expected):
    model, tokenizer, drafter, *_ = pair
    engine = BatchEngine(model, tokenizer, drafter, EngineConfig(max_batch=8))
    try:
        handles = {
            (name, seed): engine.submit(
                GenerationRequest(PROMPT, SETTINGS[name], MAX_TOKENS, seed)
            )
            for name in SETTINGS
            for seed in SEEDS
        }
        engine.start()
        for key, handle in handles.items():
            assert served(handle) == served_as(expected[key], tokenizer), key
    finally:
        engine.stop()
    assert engine.stats.drafts_accepted > 0


def test_residual_sampling_still_available(pair, expected):
    """``sampling="residual"`` is the rejection-sampling rule: exact in
    distribution, not mlx-lm's draws; a bad name is one sentence."""
    model, tokenizer, drafter, *_ = pair
    params = SETTINGS["t1"]
    got = [
        dspark_tokens(
            model, tokenizer, drafter, params, s, sampling="residual", num_draft=3
        )[0]
        for s in SEEDS
    ]
    assert got != [expected[("t1", s)] for s in SEEDS]
    with pytest.raises(DSparkError, match="coupled or residual"):
        dspark_tokens(model, tokenizer, drafter, params, 0, sampling="gumbel")
    assert resolve_sampling(None, 3) == "coupled"
    assert resolve_sampling(None, None) == "residual"  # measured: more accepted
    assert resolve_sampling("residual", 3) == "residual"
