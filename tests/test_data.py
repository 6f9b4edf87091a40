"""Training data: the default recipe's prompts, regeneration and answer shards."""

import gzip
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlx_dspark.errors import DSparkError
from mlx_dspark.loading import load
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.training.data import (
    generate_answers,
    load_sequences,
    regenerate,
    regenerate_shards,
    shard_name,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import drafter_prompts  # noqa: E402
import plot_learning_curves  # noqa: E402
import train_default_drafter as recipe  # noqa: E402

EOS = 30  # the structured target's end-of-sequence token
PROMPTS = [[1, 2], [7, 8, 9], [20, 4], [0, 3], [13, 5, 5], [11]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target_dir, _ = build_structured_pair(tmp_path_factory.mktemp("pair"), PairSpec())
    model, tokenizer, _ = load(target_dir)
    return model, tokenizer


def greedy(model, prompt, max_tokens):
    tokens = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


# --- prompts -----------------------------------------------------------------


def test_prompts_are_deterministic_and_sized():
    counts = {"chat": 300, "code": 80, "maths": 120}
    first = drafter_prompts.build_prompts(counts, recipe.HELD_OUT_PROMPTS, seed=0)
    assert first == drafter_prompts.build_prompts(
        counts, recipe.HELD_OUT_PROMPTS, seed=0
    )
    assert first != drafter_prompts.build_prompts(
        counts, recipe.HELD_OUT_PROMPTS, seed=1
    )
    kinds = [k for k, _ in first]
    assert {k: kinds.count(k) for k in counts} == counts
    texts = [p for _, p in first]
    assert len(set(texts)) == len(texts)


def test_recipe_prompts_fill_their_counts_without_held_out_prompts():
    prompts = drafter_prompts.build_prompts(
        recipe.PROMPT_COUNTS, recipe.HELD_OUT_PROMPTS
    )
    assert len(prompts) == sum(recipe.PROMPT_COUNTS.values())
    texts = [p for _, p in prompts]
    assert drafter_prompts.near_duplicates(texts, recipe.HELD_OUT_PROMPTS) == []
    assert not set(texts) & set(recipe.HELD_OUT_PROMPTS)
    # Every held-out chat question is among those checked against.
    assert set(recipe.HELD_OUT_CHAT) <= set(recipe.HELD_OUT_PROMPTS)


def test_near_duplicates_catches_a_paraphrase():
    held = ["Explain what a black hole is in simple terms."]
    found = drafter_prompts.near_duplicates(
        ["Explain black holes in simple terms.", "Explain compilers in simple terms."],
        held,
    )
    assert [p for p, _, _ in found] == ["Explain black holes in simple terms."]
    # build_prompts drops a templated prompt once it is held out.
    counts = {"chat": 50}
    some = drafter_prompts.build_prompts(counts, [])[0][1]
    again = drafter_prompts.build_prompts(counts, [some])
    assert some not in [p for _, p in again] and len(again) == 50


# --- regeneration ------------------------------------------------------------


def write_prompts(path: Path) -> Path:
    path.write_text(
        "\n".join(json.dumps({"prompt": f"t{i} t{i + 1}"}) for i in range(5)) + "\n"
    )
    return path


def test_regenerate_at_two_temperatures_resumes(target, tmp_path):
    model, tokenizer = target
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "regen.jsonl"
    kwargs = dict(seq_len=64, max_tokens=12, batch_size=2, temperature=[0.0, 1.0])
    seen = []
    regenerate(
        [prompts], model, tokenizer, out, progress=lambda *a: seen.append(a), **kwargs
    )
    lines = out.read_text().splitlines()
    assert len(lines) == 10 and seen[-1] == (10, 10)
    records = [json.loads(line) for line in lines]
    assert [r["temperature"] for r in records] == [0.0] * 5 + [1.0] * 5
    # T=0 is greedy; T=1 samples (differently on at least one prompt).
    assert records[1]["tokens"] == [1, 2, *greedy(model, [1, 2], 12)]
    assert [r["tokens"] for r in records[:5]] != [r["tokens"] for r in records[5:]]
    # Interrupted in the second temperature's first batch: the rerun completes it.
    out.write_text("\n".join(lines[:6]) + "\n" + lines[6][:7])
    regenerate([prompts], model, tokenizer, out, **kwargs)
    assert out.read_text().splitlines() == lines


def test_generate_answers_batches_beyond_32(target):
    model, tokenizer = target
    prompts = [[i % 30, (3 * i) % 30] for i in range(40)]
    answers = generate_answers(
        model, tokenizer, prompts, max_tokens=6, temperature=0.0, seed=0
    )
    assert answers[33] == greedy(model, prompts[33], 6)


def test_shards_are_complete_resumable_and_readable(target, tmp_path):
    model, tokenizer = target
    tags = ["chat", "code", "maths", "chat", "code", "maths"]
    kwargs = dict(
        shard_size=4, temperatures=(0.0, 0.7), max_tokens=10, seed=3, tags=tags
    )
    calls = []
    paths = regenerate_shards(
        PROMPTS,
        model,
        tokenizer,
        tmp_path,
        progress=lambda *a: calls.append(a),
        **kwargs,
    )
    names = [shard_name(t, i) for i in (0, 1) for t in (0.0, 0.7)]
    assert [p.name for p in paths] == names == [
        "t000-0000.jsonl.gz", "t070-0000.jsonl.gz", "t000-0001.jsonl.gz", "t070-0001.jsonl.gz"
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # no temp files
    assert [c[:2] for c in calls] == [(4, 12), (8, 12), (10, 12), (12, 12)]
    assert all(c[2] > 0 for c in calls)
    lines = gzip.decompress((tmp_path / names[2]).read_bytes()).decode().splitlines()
    first = json.loads(lines[0])
    assert first["tokens"] == [*PROMPTS[4], *greedy(model, PROMPTS[4], 10)]
    assert first["loss_start"] == 3 and first["temperature"] == 0.0
    assert [json.loads(line)["tag"] for line in lines] == tags[4:]
    sequences, report = load_sequences(paths, tokenizer, 64)
    assert len(sequences) == 12 and report.files == 4

    # A rerun skips every existing shard; a lost shard comes back byte for byte.
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}
    lost = tmp_path / names[1]
    lost.unlink()
    calls.clear()
    regenerate_shards(
        PROMPTS,
        model,
        tokenizer,
        tmp_path,
        progress=lambda *a: calls.append(a),
        **kwargs,
    )
    assert [c[:2] for c in calls] == [(12, 12)]
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.iterdir()}
    assert after[names[1]][1] == before[names[1]][1]
    assert all(after[n] == before[n] for n in names if n != names[1])


def test_shards_stop_after_the_time_budget(target, tmp_path):
    model, tokenizer = target
    paths = regenerate_shards(
        PROMPTS, model, tokenizer, tmp_path, shard_size=4, max_tokens=4, max_seconds=0
    )
    assert paths == [] and list(tmp_path.iterdir()) == []


def test_gzip_text_and_jsonl_are_read(target, tmp_path):
    _, tokenizer = target
    plain = tmp_path / "a.jsonl"
    plain.write_text(json.dumps({"tokens": [1, 2, 3, 4], "loss_start": 1}) + "\n")
    packed = tmp_path / "a.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    one, _ = load_sequences([plain], tokenizer, 64)
    two, _ = load_sequences([packed], tokenizer, 64)
    assert [s.tokens.tolist() for s in one] == [s.tokens.tolist() for s in two]


def test_binary_files_are_refused_and_text_is_not(target, tmp_path):
    _, tokenizer = target
    noise = np.random.default_rng(0).bytes(20_000)
    for name, data in (
        ("garbage.txt", noise),
        ("garbage.txt.gz", gzip.compress(noise)),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DSparkError, match="does not look like text"):
            load_sequences([path], tokenizer, 64)
    words = " ".join(f"t{i % 29}" for i in range(400))
    text = tmp_path / "notes.txt"
    text.write_text(f"café naïve résumé\t{words}\n", encoding="utf-8")
    sequences, _ = load_sequences([text], tokenizer, 64)
    assert sequences


def test_committed_prompt_list_and_answers():
    """The prompt list committed with the answers: sized, no held-out prompts."""
    listing = recipe.REGEN_DIR / recipe.PROMPT_LIST
    if not listing.exists():
        pytest.skip("no regenerated answers committed yet")
    items = [json.loads(line) for line in gzip.open(listing, "rt", encoding="utf-8")]
    kinds = [i["kind"] for i in items]
    assert {k: kinds.count(k) for k in recipe.PROMPT_COUNTS} == recipe.PROMPT_COUNTS
    texts = [i["prompt"] for i in items]
    assert drafter_prompts.near_duplicates(texts, recipe.HELD_OUT_PROMPTS) == []
    size = sum(p.stat().st_size for p in recipe.REGEN_DIR.iterdir())
    assert size < 10 * 2**20


def test_every_stage_trains_on_answers_no_other_stage_saw():
    stages = recipe.LATER_STAGES
    for folder, names in (
        (
            recipe.REGEN_DIR,
            [*recipe.FIRST_SHARDS, *(n for s in stages for n in s.shards)],
        ),
        (recipe.CONTINUATION_DIR, [n for s in stages for n in s.continued]),
        (recipe.REQUESTS_DIR, [n for s in stages for n in s.requests]),
    ):
        assert len(set(names)) == len(names), folder
        for name in names:
            assert (folder / f"{name}.jsonl.gz").exists(), name


def test_committed_continuations_are_plain_text_beginnings():
    """The continued beginnings: their counts and lengths, and each shard
    continues its 64 beginnings (prompt tokens kept, at most 96 more)."""
    listing = recipe.CONTINUATION_DIR / recipe.PROMPT_LIST
    items = [json.loads(line) for line in gzip.open(listing, "rt", encoding="utf-8")]
    kinds = [i["kind"] for i in items]
    assert {k: kinds.count(k) for k in recipe.CONTINUATIONS} == recipe.CONTINUATIONS
    assert all(
        len(i["tokens"]) == recipe.CONTINUATION_PREFIX
        for i in items
        if i["kind"] == "code"
    )
    shard = recipe.CONTINUATION_DIR / "t000-0001.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(shard, "rt", encoding="utf-8")]
    assert len(rows) == recipe.REGEN_BATCH
    for row, item in zip(rows, items[recipe.REGEN_BATCH :], strict=False):
        assert row["tokens"][: row["loss_start"]] == item["tokens"]
        assert row["tag"] == item["kind"]
        assert 0 < len(row["tokens"]) - row["loss_start"] <= recipe.CONTINUATION_TOKENS


def test_later_stages_take_the_text_that_follows(tmp_path, monkeypatch):
    modules = [f'"""{f"module {i} says " * 20}"""\nx = {i}\n' for i in range(40)]
    monkeypatch.setattr(recipe, "shuffled_modules", lambda rng: list(modules))
    monkeypatch.setattr(recipe, "CODE_CHARS", 500)
    monkeypatch.setattr(recipe, "DOC_CHARS", 300)
    stages = (
        recipe.Stage((), 400, 200, steps=1),
        recipe.Stage((), 0, 0, steps=1, continued=("t000-0000",)),
        recipe.Stage((), 300, 250, steps=1),
    )
    monkeypatch.setattr(recipe, "LATER_STAGES", stages)
    (tmp_path / "corpus").mkdir()
    second = [p.read_text() for p in recipe.stage_text(tmp_path, 0, 2)]
    assert recipe.stage_text(tmp_path, 0, 3) == []
    third = [p.read_text() for p in recipe.stage_text(tmp_path, 0, 4)]
    code, docs = "\n\n".join(modules), "\n\n".join(recipe.docstrings(modules))
    assert [len(t) for t in second + third] == [400, 200, 300, 250]
    assert second[0] + third[0] == code[500:1200]
    assert second[1] + third[1] == docs[300:750]


def test_a_stage_continues_the_one_its_after_names(monkeypatch):
    stages = (
        recipe.Stage((), 0, 0, steps=1),
        recipe.Stage((), 0, 0, steps=1),
        recipe.Stage((), 0, 0, steps=1, after=2),
        recipe.Stage((), 0, 0, steps=1),
    )
    monkeypatch.setattr(recipe, "LATER_STAGES", stages)
    assert recipe.lineage(1) == [1]
    assert recipe.lineage(3) == [1, 2, 3]
    assert recipe.lineage(4) == [1, 2, 4]
    assert recipe.lineage(5) == [1, 2, 4, 5]


def test_chained_curves_start_where_the_run_before_ended():
    first = ([1.0, 2.0, 5.0], [1.1, 1.2, 1.3])
    second = ([0.5, 1.5], [1.25, 1.35])
    shifted = plot_learning_curves.chained([first, second])
    assert shifted == [first, ([5.5, 6.5], [1.25, 1.35])]


def test_a_prompt_list_is_written_once_and_read_back(tmp_path):
    listing = tmp_path / recipe.PROMPT_LIST
    first = recipe.committed_prompts(listing, lambda: [{"kind": "code", "tokens": [1]}])
    again = recipe.committed_prompts(
        listing, lambda: [{"kind": "prose", "tokens": [2]}]
    )
    assert first == again == [{"kind": "code", "tokens": [1]}]
    assert [p.name for p in tmp_path.iterdir()] == [recipe.PROMPT_LIST]
