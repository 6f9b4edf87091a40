"""The suffix store against a brute-force reference (plain Python over lists)
on random token sequences with small vocabularies, so that matches, ties and
branching continuations are common."""

from __future__ import annotations

import heapq
import math
import random

import numpy as np
import pytest

from mlx_dspark.errors import DSparkError
from mlx_dspark.proposers import suffix_store as ss

# ------------------------------------------------------------ the reference


def ref_occurrences(docs, context, max_depth):
    """docs: [(doc_id, tokens)]. Returns (longest match, [(doc_id, position)])
    over positions followed by a token in their document."""
    tail = list(context[-max_depth:]) if max_depth > 0 else []
    best, found = 0, []
    for doc_id, tokens in docs:
        for p in range(len(tokens) - 1):
            n = 0
            while n < len(tail) and p - n >= 0 and tokens[p - n] == tail[-1 - n]:
                n += 1
            if n > best:
                best, found = n, []
            if n == best and n > 0:
                found.append((doc_id, p))
    return best, found


def ref_rows(docs, occurrences, length, max_occurrences):
    by_id = dict(docs)
    ordered = sorted(occurrences, reverse=True)[:max_occurrences]
    rows = []
    for doc_id, p in ordered:
        row = list(by_id[doc_id][p + 1 : p + 1 + length])
        rows.append(row + [-1] * (length - len(row)))
    return rows


def ref_trie(rows):
    """Nodes keyed by path tuple: count, going on, most recent row."""
    count, going, recency = {}, {}, {}
    for r, row in enumerate(rows):
        path = ()
        for token in row:
            if token < 0:
                break
            going[path] = going.get(path, 0) + 1
            path = path + (token,)
            count[path] = count.get(path, 0) + 1
            recency[path] = min(recency.get(path, r), r)
    return count, going, recency


def ref_draft(rows, max_tokens, min_prob, tree):
    count, going, recency = ref_trie(rows)

    def children(path):
        return [p for p in count if len(p) == len(path) + 1 and p[:-1] == path]

    def prob_of(path, parent_prob):
        return parent_prob * (count[path] / going[path[:-1]])

    tokens, parents, probs = [], [], []
    if max_tokens <= 0 or not rows:
        return tokens, parents, probs
    if not tree:
        path, prob = (), 1.0
        while len(tokens) < max_tokens:
            kids = children(path)
            if not kids:
                break
            kid = min(kids, key=lambda p: (-count[p], recency[p]))
            p = prob_of(kid, prob)
            if p < min_prob:
                break
            parents.append(len(tokens) - 1)
            tokens.append(kid[-1])
            probs.append(p)
            path, prob = kid, p
        return tokens, parents, probs
    heap = []
    for kid in children(()):
        p = prob_of(kid, 1.0)
        heapq.heappush(heap, (-p, len(kid), recency[kid], kid, -1))
    while heap and len(tokens) < max_tokens:
        neg, _, _, path, parent = heapq.heappop(heap)
        if -neg < min_prob:
            break
        tokens.append(path[-1])
        parents.append(parent)
        probs.append(-neg)
        for kid in children(path):
            p = prob_of(kid, -neg)
            heapq.heappush(heap, (-p, len(kid), recency[kid], kid, len(tokens) - 1))
    return tokens, parents, probs


def ref_propose_one(docs, context, config, tree):
    length, occ = ref_occurrences(docs, context, config.max_depth)
    if length == 0 or length < config.min_match:
        return 0, [], [], []
    budget = min(config.max_draft, math.ceil(config.alpha * length - 1e-9))
    rows = ref_rows(docs, occ, budget, config.max_occurrences)
    tokens, parents, probs = ref_draft(rows, budget, config.min_prob, tree)
    return length, tokens, parents, probs


def assert_draft(draft, expected):
    length, tokens, parents, probs = expected
    assert draft.tokens.tolist() == tokens
    assert draft.parents.tolist() == parents
    np.testing.assert_allclose(draft.probs, np.array(probs, np.float32), rtol=1e-6)
    if tokens:
        assert draft.match_length == length


def random_config(rng):
    return ss.SuffixConfig(
        max_depth=rng.choice([1, 2, 3, 5, 64]),
        alpha=rng.choice([0.5, 1.0, 1.5, 3.0]),
        max_draft=rng.choice([1, 3, 8, 16]),
        min_prob=rng.choice([0.0, 0.1, 0.3]),
        min_match=rng.choice([1, 1, 2]),
        max_occurrences=rng.choice([1, 3, 256]),
    )


# ------------------------------------------------------------ request index


def test_request_matches_and_drafts_equal_the_reference():
    rng = random.Random(0)
    for _ in range(400):
        vocab = rng.randint(2, 5)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        config = random_config(rng)
        request = ss.SuffixRequest(tokens[:5], None, config)
        for t in tokens[5:]:
            request.append(t)
        docs = [(0, tokens)]
        length, occ = ref_occurrences(docs, tokens, config.max_depth)
        match = request.index.match(tokens, config.max_depth)
        if length == 0:
            assert match is None
            continue
        assert match.length == length
        assert match.count == len(occ)
        width = rng.randint(1, 6)
        assert match.windows(width, config.max_occurrences).tolist() == ref_rows(
            docs, occ, width, config.max_occurrences
        )
        for tree in (False, True):
            expected = ref_propose_one(docs, tokens, config, tree)
            assert_draft(request.propose(tree=tree), expected)


def test_draft_from_windows_equals_the_reference_heap_and_greedy_chain():
    rng = random.Random(1)
    for _ in range(500):
        rows = []
        for _ in range(rng.randint(1, 12)):
            n = rng.randint(1, 6)
            row = [rng.randrange(3) for _ in range(n)]
            rows.append(row + [-1] * (6 - n))
        budget, min_prob = rng.randint(1, 10), rng.choice([0.0, 0.05, 0.2, 0.5])
        for tree in (False, True):
            tokens, parents, probs = ss.draft_from_windows(
                np.array(rows, np.int32), budget, min_prob, tree
            )
            want = ref_draft([r[:budget] for r in rows], budget, min_prob, tree)
            assert (tokens.tolist(), parents.tolist()) == want[:2]
            np.testing.assert_allclose(probs, np.array(want[2], np.float32))
            if tree:
                assert all(p < i for i, p in enumerate(parents.tolist()))


def test_probabilities_are_count_ratios():
    # "1 2" is followed by 3 twice and 4 once; "1 2 3" by 5 twice.
    request = ss.SuffixRequest([1, 2, 3, 5, 8, 1, 2, 4, 6, 1, 2, 3, 5, 9, 1, 2])
    request.config = ss.SuffixConfig(alpha=4.0, min_prob=0.0)
    draft = request.propose(tree=True)
    assert draft.match_length == 2
    assert draft.tokens.tolist()[:5] == [3, 5, 4, 6, 9]
    np.testing.assert_allclose(draft.probs[:3], [2 / 3, 2 / 3, 1 / 3], rtol=1e-6)
    assert draft.parents.tolist()[:5] == [-1, 0, -1, 2, 1]
    assert draft.score == pytest.approx(float(draft.probs.sum()))


def test_draft_length_grows_with_the_match():
    config = ss.SuffixConfig(alpha=2.0, max_draft=5)
    assert [config.draft_budget(m) for m in (0, 1, 2, 3, 9)] == [0, 2, 4, 5, 5]
    text = list(range(20))
    for m in (1, 2, 3):
        request = ss.SuffixRequest(text + [99] + text[:m], None, config)
        draft = request.propose()
        assert draft.match_length == m
        assert len(draft) == min(5, 2 * m)
        assert draft.tokens.tolist() == text[m : m + len(draft)]


# ------------------------------------------------------------ global store


class RefStore:
    """The global store's contents and eviction, as plain lists."""

    def __init__(self, max_tokens, max_documents):
        self.max_tokens, self.max_documents = max_tokens, max_documents
        self.docs, self.next_id = {}, 0  # id -> list, in id order

    def open(self):
        doc = self.next_id
        self.next_id += 1
        self.docs[doc] = []
        self.evict()
        return doc

    def extend(self, doc, tokens):
        if doc in self.docs:
            self.docs[doc].extend(tokens)
            self.evict()

    def evict(self):
        while self.docs and (
            sum(map(len, self.docs.values())) > self.max_tokens
            or len(self.docs) > self.max_documents
        ):
            del self.docs[next(iter(self.docs))]


def test_global_store_equals_the_reference_with_live_documents_and_eviction():
    rng = random.Random(2)
    for trial in range(40):
        vocab = rng.randint(2, 4)
        store = ss.SuffixStore(
            max_tokens=rng.choice([40, 120, 10_000]),
            max_documents=rng.choice([3, 6, 1000]),
            freeze_tokens=rng.choice([1, 8, 30]),
        )
        ref = RefStore(store.max_tokens, store.max_documents)
        live = []
        for _ in range(60):
            action = rng.random()
            if action < 0.15 or not live:
                doc = store.open()
                assert ref.open() == doc
                live.append(doc)
            elif action < 0.25:
                doc = live.pop(rng.randrange(len(live)))
                store.close(doc)
            else:
                doc = rng.choice(live)
                tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
                if len(tokens) == 1:
                    store.append(doc, tokens[0])
                else:
                    store.extend(doc, tokens)
                ref.extend(doc, tokens)
            assert store.document_ids() == list(ref.docs)
            assert [d.tolist() for d in store.documents()] == list(ref.docs.values())
            assert store.num_tokens == sum(map(len, ref.docs.values()))
            context = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            config = random_config(rng)
            docs = list(ref.docs.items())
            length, occ = ref_occurrences(docs, context, config.max_depth)
            match = store.match(context, config.max_depth)
            assert (match.length if match else 0) == length, trial
            if match:
                width = 7
                got = match.windows(width)
                assert got.tolist() == ref_rows(docs, occ, width, len(occ) + 1)
                for tree in (False, True):
                    draft = ss.draft_from_match(match, config, tree)
                    assert_draft(draft, ref_propose_one(docs, context, config, tree))


def test_eviction_drops_the_oldest_documents_first():
    store = ss.SuffixStore(max_tokens=10, freeze_tokens=4)
    first = store.add_document([1, 2, 3, 4])
    second = store.add_document([5, 6, 7])
    live = store.open([8, 9])
    assert store.document_ids() == [first, second, live]
    store.extend(live, [10, 11])  # 11 tokens: the first document goes
    assert store.document_ids() == [second, live]
    assert store.match([1, 2]) is None
    assert store.match([5, 6]).length == 2
    third = store.add_document([12] * 6)
    assert store.document_ids() == [live, third]
    store.extend(live, [13])  # 11 tokens: the oldest, the live one, goes
    assert store.document_ids() == [third]
    store.extend(live, [14])  # ignored: evicted
    assert store.num_tokens == 6
    store = ss.SuffixStore(max_documents=2)
    ids = [store.add_document([i, i]) for i in range(4)]
    assert store.document_ids() == ids[2:]


def test_concurrent_requests_draft_from_each_other_live():
    store = ss.SuffixStore()
    config = ss.SuffixConfig(alpha=2.0)
    writer = ss.SuffixRequest([7, 7, 7], store, config)
    reader = ss.SuffixRequest([8, 8, 1, 2, 3], store, config)
    assert len(reader.propose()) == 0
    writer.extend([1, 2, 3, 4, 5, 6])  # not closed: still being written
    draft = reader.propose()
    assert draft.source == "global"
    assert draft.tokens.tolist() == [4, 5, 6]
    assert draft.match_length == 3
    # The reader's own text wins a tie, then a better global candidate wins.
    reader.extend([4, 9, 1, 2, 3])
    assert reader.propose().source == "request"
    writer.extend([1, 2, 3, 4, 5, 6])
    writer.close()
    draft = reader.propose()
    assert draft.source == "global"
    assert draft.tokens.tolist() == [4, 5, 6, 1, 2, 3]  # one row went on


def test_runs_merge_and_stay_consistent():
    rng = random.Random(3)
    store = ss.SuffixStore(freeze_tokens=16)
    docs = []
    for _ in range(60):
        doc = [rng.randrange(4) for _ in range(rng.randint(2, 12))]
        docs.append(doc)
        store.add_document(doc)
    assert len(store._runs) <= 8
    for _ in range(80):
        # Slices of stored text: long matches, past the six sorted tokens.
        doc = rng.choice(docs)
        end = rng.randint(1, len(doc))
        context = [rng.randrange(4)] + doc[max(0, end - rng.randint(1, 12)) : end]
        length, occ = ref_occurrences(list(enumerate(docs)), context, 64)
        match = store.match(context)
        assert (match.length if match else 0) == length
        if match:
            assert match.count == len(occ)


# ------------------------------------------------------------ files


def test_phrase_store_files_fill_the_global_part(tmp_path):
    documents = [[5, 6, 7, 8], [1, 2], [300, 70000, 5, 6, 9]]
    path = tmp_path / "phrases.npy"
    ss.write_phrases(path, documents)
    store = ss.SuffixStore()
    assert store.add_phrases(path) == 3
    assert [d.tolist() for d in store.documents()] == documents
    match = store.match([0, 5, 6])
    assert match.length == 2 and match.count == 2
    assert match.windows(2).tolist() == [[9, -1], [7, 8]]
    np.save(tmp_path / "bad.npy", np.array([1.5, 0.0]))
    with pytest.raises(DSparkError):
        store.add_phrases(tmp_path / "bad.npy")


def test_save_and_load_round_trip(tmp_path):
    rng = random.Random(4)
    store = ss.SuffixStore(freeze_tokens=20)
    for _ in range(12):
        store.add_document([rng.randrange(50) for _ in range(rng.randint(0, 15))])
    live = store.open([1, 2, 3])
    store.extend(live, [4])
    path = tmp_path / "store" / "suffix.npz"
    store.save(path, "tokenizer-A")
    loaded = ss.SuffixStore.load(path, "tokenizer-A")
    want = [d.tolist() for d in store.documents()]
    assert [d.tolist() for d in loaded.documents()] == want
    for _ in range(30):
        context = [rng.randrange(50) for _ in range(3)]
        a, b = store.match(context), loaded.match(context)
        assert (a and (a.length, a.windows(4).tolist())) == (
            b and (b.length, b.windows(4).tolist())
        )
    assert [p.name for p in path.parent.iterdir()] == ["suffix.npz"]
    # A path without the .npz suffix is written as given.
    store.save(tmp_path / "store.bin", "tokenizer-A")
    assert ss.SuffixStore.load(tmp_path / "store.bin", "tokenizer-A").num_documents


def _one_sentence(error):
    text = str(error.value)
    return text.endswith(".") and text.count(". ") == 0 and "\n" not in text


def test_bad_store_files_are_refused_in_one_sentence(tmp_path):
    store = ss.SuffixStore()
    store.add_document(list(range(1000)))
    path = tmp_path / "suffix.npz"
    store.save(path, "tok-A")
    data = path.read_bytes()
    cases = {
        "foreign": (data, "tok-B"),
        "truncated": (data[: len(data) // 2], "tok-A"),
        "empty": (b"", "tok-A"),
        "garbage": (b"not a store at all" * 10, "tok-A"),
    }
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside the tokens: the CRC catches it
    cases["flipped"] = (bytes(flipped), "tok-A")
    for name, (content, fingerprint) in cases.items():
        bad = tmp_path / f"{name}.npz"
        bad.write_bytes(content)
        with pytest.raises(DSparkError) as error:
            ss.SuffixStore.load(bad, fingerprint)
        assert _one_sentence(error), (name, str(error.value))
        if name == "foreign":
            assert "another tokenizer" in str(error.value)
    other = tmp_path / "other.npz"
    np.savez(other, tokens=np.arange(3))
    with pytest.raises(DSparkError) as error:
        ss.SuffixStore.load(other, "tok-A")
    assert "not a suffix store" in str(error.value)
    with pytest.raises(DSparkError):
        ss.SuffixStore.load(tmp_path / "missing.npz", "tok-A")
    # The good file is untouched and still loads.
    assert ss.SuffixStore.load(path, "tok-A").num_tokens == 1000


def test_the_request_draft_wins_a_tie():
    store = ss.SuffixStore()
    store.add_document([1, 2, 3, 4, 0, 1])
    request = ss.SuffixRequest([1, 2, 3, 4, 0, 1, 7, 1, 2, 3], store)
    draft = request.propose()
    assert (draft.source, draft.tokens.tolist(), draft.score) == (
        "request",
        [4, 0, 1],
        3,
    )
    store.add_document([1, 2, 3, 4, 0, 1, 5])  # two rows agree: still a tie
    assert request.propose().source == "request"
    store.add_document([7, 1, 2, 3, 4, 0, 1, 8])  # a longer match, 4 tokens
    assert request.propose().source == "global"
