"""Gemma-4 targets: logits, taps, exact rollback of sliding windows, greedy
identity, batched verification and exact sampling on tiny mlx-lm models with
a window shorter than the generation, KV-shared layers and per-layer inputs."""

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import HEADS, head_id
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma4, gemma4_text
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from test_sampling import chi_square, chi_square_critical

from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.decoding.modes import ChainMode
from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.policies import verify_batch
from mlx_dspark.proposers.base import Proposal
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.proposers.dspark import DSparkDrafter
from mlx_dspark.proposers.dspark_config import DraftConfig
from mlx_dspark.sampling.processing import SamplingParams, log_probs
from mlx_dspark.targets.adapter import TargetAdapter, WindowKVCache

VOCAB = 16
WINDOW = 6
TAPS = [0, 3]
PROMPTS = [[1, 2, 3], [5, 7, 1, 2, 9, 3, 4, 0, 2, 11, 6]]
MAX_TOKENS = 40  # several windows


def text_config(**overrides) -> dict:
    config = {
        "model_type": "gemma4_text",
        "hidden_size": 32,
        "num_hidden_layers": 6,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_key_value_heads": 1,
        "num_kv_shared_layers": 2,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 4,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 3,
        "final_logit_softcapping": 4.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def tiny_gemma4(seed: int = 0, wrapper: bool = False, **overrides):
    """mlx-lm's own Gemma-4 class with weights whose greedy output varies:
    the LM head maps each token's embedding to a permuted token and the
    random layers perturb that with context."""
    config = text_config(**overrides)
    if wrapper:
        model = gemma4.Model(
            gemma4.ModelArgs.from_dict(
                {"model_type": "gemma4", "text_config": config, "vocab_size": VOCAB}
            )
        )
        prefix = "language_model."
    else:
        model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
        prefix = ""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("norm.weight", "layer_scalar")):
            weights[name] = np.ones(value.shape, np.float32)
        else:
            weights[name] = rng.standard_normal(value.shape).astype(
                np.float32
            ) / np.sqrt(value.shape[-1])
    d = config["hidden_size"]
    embed = rng.standard_normal((VOCAB, d)).astype(np.float32) / np.sqrt(d)
    weights[prefix + "model.embed_tokens.weight"] = embed
    if not config["tie_word_embeddings"]:
        head = np.zeros((VOCAB, d), np.float32)
        head[rng.permutation(VOCAB)] = 8 * embed
        weights[prefix + "lm_head.weight"] = head
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    mx.eval(model.parameters())
    return model


def random_drafter(target: TargetAdapter, head, block_size: int = 6, seed: int = 0):
    config = DraftConfig.from_dict(
        {
            "architectures": ["Qwen3DSparkModel"],
            "hidden_size": target.hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 64,
            "vocab_size": VOCAB,
            "block_size": block_size,
            "mask_token_id": VOCAB - 1,
            "target_layer_ids": TAPS,
            "markov_rank": 8 if head else 0,
            "markov_head_type": head,
            "enable_confidence_head": True,
            "confidence_head_with_markov": bool(head),
        }
    )
    mx.random.seed(seed)
    drafter = DSparkDrafter(config)
    drafter.share_embeddings(target.embed, target.lm_head)
    mx.eval(drafter.parameters())
    return drafter


def plain_greedy(model, prompt, max_tokens=MAX_TOKENS) -> list[int]:
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]


def temporal(cache: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """The rotating cache's keys and values, oldest first."""
    keys, values, offset, _, size, idx = cache.state
    if offset <= size:
        return keys[..., :offset, :], values[..., :offset, :]
    order = mx.array([*range(idx, size), *range(idx)])
    return keys[..., order, :], values[..., order, :]


MODELS = {
    "gemma4_text": lambda: tiny_gemma4(),
    "gemma4": lambda: tiny_gemma4(seed=1, wrapper=True),
    "k_eq_v": lambda: tiny_gemma4(
        seed=2, attention_k_eq_v=True, num_global_key_value_heads=2
    ),
    "no_sharing": lambda: tiny_gemma4(
        seed=3, num_kv_shared_layers=0, hidden_size_per_layer_input=0
    ),
}


@pytest.fixture(scope="module")
def model():
    return tiny_gemma4()


@pytest.mark.parametrize("name", MODELS)
def test_adapter_logits_equal_the_models_call(name):
    model = MODELS[name]()
    adapter = TargetAdapter(model, TAPS)
    tokens = mx.array([[t % VOCAB for t in range(3 * WINDOW + 1)]])
    ours, features = adapter(tokens, adapter.make_cache())
    theirs = model(tokens)
    assert mx.array_equal(ours, theirs).item()
    # The soft cap is part of what is verified.
    assert mx.abs(ours).max().item() <= 4.0
    assert features.shape == (1, tokens.shape[1], 2 * adapter.hidden_size)
    # Tap -1 is the scaled embedding, as DeepSpec's hidden_states[0].
    adapter = TargetAdapter(model, [-1])
    _, features = adapter(tokens, adapter.make_cache())
    scaled = adapter.embed(tokens) * adapter.inner.embed_scale
    assert mx.array_equal(features, scaled).item()
    adapter.self_check()


@pytest.mark.parametrize("name", MODELS)
def test_decoding_with_rollbacks_equals_plain_decoding(name):
    """Rounds of 1..6 tokens, partly rejected and rolled back, give plain
    decoding's logits, and afterwards hold plain decoding's caches: the last
    window of every sliding-window layer and every full-attention key."""
    model = MODELS[name]()
    adapter = TargetAdapter(model, TAPS)
    prompt = PROMPTS[1]
    sequence = prompt + plain_greedy(model, prompt, 5 * WINDOW)
    plain = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=plain)
    plain_logits = [
        model(mx.array([[t]]), cache=plain)[0, -1] for t in sequence[len(prompt) - 1 :]
    ]
    cache = adapter.make_cache()
    adapter(mx.array([prompt[:-1]]), cache)
    rng = np.random.default_rng(0)
    position, rejected = len(prompt) - 1, 0
    while position < len(sequence) - 7:
        size = int(rng.integers(1, 7))
        keep = int(rng.integers(1, size + 1))
        block = sequence[position : position + size]
        if keep < size:
            block[keep] = (block[keep] + 1) % VOCAB
            rejected += 1
        logits, _ = adapter(mx.array([block]), cache)
        adapter.rollback(cache, size - keep)
        for i in range(keep):
            want = plain_logits[position + i - len(prompt) + 1]
            # Blocks of other lengths round differently: float32 sums differ
            # by CPU (over 1e-4 on AMD EPYC); a wrong rollback is off by O(1).
            assert mx.allclose(logits[0, i], want, atol=1e-3).item()
        position += keep
    assert rejected > 5
    # Plain decoding to the same point.
    plain = make_prompt_cache(model)
    model(mx.array([sequence[:position]]), cache=plain)
    # KV-shared layers have no cache of their own.
    shared = model.layers[0].self_attn.config.num_kv_shared_layers
    assert len(cache) == len(plain) == len(model.layers) - shared
    for ours, theirs in zip(cache, plain, strict=True):
        assert ours.offset == theirs.offset == position
        if isinstance(theirs, RotatingKVCache):
            assert isinstance(ours, WindowKVCache)
            want = temporal(theirs)
            # Prefill leaves more than a window in mlx-lm's cache: compare the window.
            want = tuple(w[..., -WINDOW:, :] for w in want)
            got = ours.window_state()
        else:
            assert isinstance(ours, KVCache)
            want = tuple(s[..., :position, :] for s in theirs.state[:2])
            got = tuple(s[..., :position, :] for s in ours.state[:2])
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert mx.allclose(g, w, atol=1e-3).item()


def test_window_cache_refuses_a_rollback_past_its_window():
    cache = WindowKVCache(4)
    for _ in range(20):
        cache.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    big = mx.zeros((1, 1, 300, 2))
    cache.update_and_fetch(big, big)
    cache.trim(300)  # the whole last update: exact
    assert cache.offset == 20
    with pytest.raises(DSparkError, match="rolls back at most"):
        cache.trim(260)


class OracleMode(ChainMode):
    """Drafts plain decoding's own continuation with one of its first three
    tokens corrupted, so that every window of output holds accepted drafts
    and a rejection; every third round of at most two drafts is left whole."""

    def __init__(self, generated: list[int], seed: int = 0):
        self.generated, self.position, self.rounds = generated, 0, 0
        self.rng = np.random.default_rng(seed)

    def propose(self, proposer, state, round):
        proposal = super().propose(proposer, state, round)
        cap = round.cap
        drafts = self.generated[self.position + 1 : self.position + 1 + cap]
        drafts += [0] * (cap - len(drafts))
        if not (cap <= 2 and self.rounds % 3 == 2):
            cut = int(self.rng.integers(0, min(cap, 3)))
            drafts[cut] = (drafts[cut] + 1) % VOCAB
        self.rounds += 1
        return Proposal(mx.array([drafts]), proposal.logits, proposal.confidence)

    def verify(self, target, cache, anchor, proposal, n, params, rng):
        result = super().verify(target, cache, anchor, proposal, n, params, rng)
        self.position += result[0].accepted + 1
        return result


@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_greedy_identical_to_mlx_lm(model, head):
    adapter = TargetAdapter(model, TAPS)
    drafter = random_drafter(adapter, head)
    for prompt in PROMPTS:
        expected = plain_greedy(model, prompt)
        for num_draft in (1, 2, 5):
            for oracle in (False, True):
                stats = GenerationStats()
                mode = OracleMode(expected, seed=num_draft) if oracle else None
                tokens = speculative_generate_step(
                    mx.array(prompt),
                    adapter,
                    pair_proposer(drafter),
                    num_draft=num_draft,
                    max_tokens=MAX_TOKENS,
                    mode=mode,
                    stats=stats,
                )
                assert [t for t, _ in tokens] == expected, (prompt, num_draft, oracle)
                if oracle:
                    # Accepted drafts, whole blocks, and a rejection in every window.
                    rounds = stats.rounds
                    assert sum(r.accepted for r in rounds) > 0
                    assert any(r.accepted == r.verified for r in rounds)
                    end, rejected_at = 1, []
                    for r in rounds:
                        if r.accepted < r.verified:
                            rejected_at.append(end + r.accepted)
                        end += r.accepted + 1
                    edges = [0, *rejected_at, MAX_TOKENS]
                    assert max(np.diff(edges)) <= WINDOW, edges


@pytest.mark.parametrize("name", MODELS)
def test_greedy_identical_on_every_model_variant(name):
    model = MODELS[name]()
    adapter = TargetAdapter(model, TAPS)
    drafter = random_drafter(adapter, "vanilla")
    prompt = PROMPTS[1]
    expected = plain_greedy(model, prompt)
    for mode in (None, OracleMode(expected)):
        tokens = speculative_generate_step(
            mx.array(prompt),
            adapter,
            pair_proposer(drafter),
            num_draft=2,
            max_tokens=MAX_TOKENS,
            mode=mode,
        )
        assert [t for t, _ in tokens] == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_verification_equals_single(model, temperature):
    adapter = TargetAdapter(model, TAPS)
    drafter = random_drafter(adapter, "vanilla")
    params = SamplingParams(temperature=temperature)
    prompts = [[1, 2, 3], PROMPTS[1], [5] * 9]
    lengths = [5, 0, 3]
    singles, batches, anchors, proposals = [], [], [], []
    for r, prompt in enumerate(prompts):
        single, batch = adapter.make_cache(), adapter.make_cache()
        for cache in (single, batch):
            logits, features = adapter(mx.array([prompt]), cache)
        anchor = int(mx.argmax(logits[0, -1]).item())
        hidden = drafter(
            drafter.block_tokens(mx.array([anchor])),
            len(prompt),
            features,
            drafter.make_cache(),
        )
        proposals.append(
            drafter.propose(hidden, mx.array([anchor]), 5, params, mx.random.key(r))
        )
        singles.append(single)
        batches.append(batch)
        anchors.append(anchor)
    for _ in range(3):  # several rounds, past the window
        one = [
            ChainMode().verify(adapter, c, a, p, n, params, np.random.default_rng(r))
            for r, (c, a, p, n) in enumerate(
                zip(singles, anchors, proposals, lengths, strict=True)
            )
        ]
        many = verify_batch(
            adapter,
            batches,
            anchors,
            proposals,
            lengths,
            params,
            [np.random.default_rng(r) for r in range(len(prompts))],
        )
        for (v1, d1, f1), (v2, d2, f2), c1, c2 in zip(
            one, many, singles, batches, strict=True
        ):
            assert (v1.accepted, v1.next_token) == (v2.accepted, v2.next_token)
            assert d1 == d2
            assert mx.allclose(f1, f2, atol=1e-4).item()
            for l1, l2 in zip(c1, c2, strict=True):
                assert l1.offset == l2.offset
                for a, b in zip(l1.state[:2], l2.state[:2], strict=True):
                    assert mx.allclose(
                        a[..., -l1.offset :, :], b[..., -l2.offset :, :], atol=1e-4
                    ).item()
        anchors = [v.next_token for v, _, _ in one]


def test_tree_verification_is_refused(model):
    adapter = TargetAdapter(model, TAPS)
    assert not adapter.supports_tree
    with pytest.raises(
        DSparkError, match="Tree verification does not support gemma4_text"
    ):
        adapter.check_tree()


# --- sampling ---------------------------------------------------------------------

SAMPLING_PROMPT = [5, 7, 1, 2, 9, 3, 4, 0]  # longer than the window
SEEDS = 1500


def exact_joint(
    model, params: SamplingParams, prompt=SAMPLING_PROMPT, vocab: int = VOCAB
) -> dict[tuple, float]:
    """P(x1, x2, x3 | prompt) of target-only sampling, by enumeration."""
    first = np.exp(np.array(log_probs(model(mx.array([prompt]))[0, -1], params)))
    pairs = [(a, b) for a in np.flatnonzero(first > 0) for b in range(vocab)]
    logits = model(mx.array([prompt + [int(a), b] for a, b in pairs]))
    second = np.exp(np.array(log_probs(logits[:, -2], params)))
    third = np.exp(np.array(log_probs(logits[:, -1], params)))
    joint = {}
    for i, (a, b) in enumerate(pairs):
        for c in np.flatnonzero(third[i] > 0):
            p = first[a] * second[i, b] * third[i, c]
            if p > 0:
                joint[(int(a), int(b), int(c))] = p
    return joint


def sample_three(adapter, drafter, prompt, params, seeds: int):
    """The first three tokens of ``seeds`` speculative generations (seed i for
    the i-th), counted, and the rounds they took."""
    samples, stats = Counter(), GenerationStats()
    for seed in range(seeds):
        tokens = speculative_generate_step(
            mx.array(prompt),
            adapter,
            pair_proposer(drafter),
            num_draft=drafter.block_size,
            params=params,
            max_tokens=3,
            seed=seed,
            stats=stats,
        )
        samples[tuple(t for t, _ in itertools.islice(tokens, 3))] += 1
    return samples, stats


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_sampling_is_exact(head):
    model = tiny_gemma4(seed=4)
    adapter = TargetAdapter(model, TAPS)
    drafter = random_drafter(adapter, head, block_size=4)
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(model, params)
    assert abs(sum(joint.values()) - 1.0) < 1e-4
    samples, stats = sample_three(adapter, drafter, SAMPLING_PROMPT, params, SEEDS)
    stat, dof = chi_square(samples, joint, SEEDS)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    assert any(r.accepted > 0 for r in stats.rounds)
    assert any(r.accepted < r.verified for r in stats.rounds)


def test_mlx_lm_runs_on_the_adapters_cache(model):
    """mlx-lm's own call accepts the adapter's caches (as the profilers use them)."""
    adapter = TargetAdapter(model, TAPS)
    ours, theirs = adapter.make_cache(), adapter.make_cache()
    prompt = mx.array([PROMPTS[1]])
    adapter(prompt, ours)
    model(prompt, cache=theirs)
    for block in ([3, 4, 5], [6], [7, 8, 9, 10, 11]):
        a, _ = adapter(mx.array([block]), ours)
        b = model(mx.array([block]), cache=theirs)
        assert mx.allclose(a, b, atol=1e-5).item()
        adapter.rollback(ours, 1)
        adapter.rollback(theirs, 1)


def test_stream_generate_with_the_scheduler_and_tree_refusal(
    model, tmp_path, monkeypatch
):
    from mlx_dspark import stream_generate
    from mlx_dspark.pairs.structured import PairSpec, _tokenizer_files
    from mlx_dspark.policy.profile import get_profile

    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    for name, text in _tokenizer_files(PairSpec(vocab_size=VOCAB)).items():
        (tmp_path / name).write_text(text)
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(tmp_path)
    adapter = TargetAdapter(model, TAPS)
    drafter = random_drafter(adapter, "vanilla")
    curve = get_profile(model, drafter, profile="refresh", contexts=(8, 20))
    assert len(curve.batch_sizes) == drafter.block_size + 1
    prompt = PROMPTS[1]
    expected = plain_greedy(model, prompt, 24)
    eos = tokenizer.eos_token_ids
    expected = expected[: next((i for i, t in enumerate(expected) if t in eos), 24)]
    for scheduler in ("auto", "threshold"):
        tokens = [
            r.token
            for r in stream_generate(
                model, tokenizer, drafter, prompt, max_tokens=24, scheduler=scheduler
            )
        ]
        assert tokens[: len(expected)] == expected, scheduler
    with pytest.raises(DSparkError, match="gemma4_text targets"):
        list(stream_generate(model, tokenizer, drafter, prompt, tree_budget=4))


def test_long_prompt_prefilled_in_chunks(model):
    """A prompt longer than one prefill chunk (512) and many windows."""
    adapter = TargetAdapter(model, TAPS)
    drafter = random_drafter(adapter, "rnn")
    prompt = np.random.default_rng(5).integers(0, VOCAB - 2, 530).tolist()
    expected = plain_greedy(model, prompt, 24)
    tokens = speculative_generate_step(
        mx.array(prompt),
        adapter,
        pair_proposer(drafter),
        num_draft=3,
        max_tokens=24,
        mode=OracleMode(expected),
    )
    assert [t for t, _ in tokens] == expected
