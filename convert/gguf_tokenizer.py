"""Hugging Face tokenizer files from a GGUF vocabulary.

GGUF stores two kinds of vocabulary: byte-level BPE (``tokenizer.ggml.model``
"gpt2": GPT-2, SmolLM2, Qwen, Llama 3) with its merges, and SentencePiece
(``"llama"``: Llama 2, Mistral, Gemma) with a score per piece. Both become a
``tokenizers`` BPE model; a SentencePiece vocabulary has no merges, so they are
derived from the scores, which is how SentencePiece's BPE encoder picks the
next pair to join (the highest-scoring piece two neighbours make).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from gguf import Keys, TokenType

from mlx_dspark.errors import DSparkError

# tokenizer.ggml.pre -> (split regex or None for GPT-2's, split digits one by one)
BPE_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "smollm": (None, True),
    "starcoder": (None, True),
    "refact": (None, True),
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        False,
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        False,
    ),
}
SPACE = "\u2581"  # SentencePiece's stand-in for a space


def _bpe_pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    regex, digits = BPE_PRE_TOKENIZERS[pre]
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is not None:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    steps.append(
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
    )
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models

    merges = meta.get(Keys.Tokenizer.MERGES)
    if not isinstance(merges, list):
        raise DSparkError("the GGUF metadata has no tokenizer.ggml.merges list.")
    pre = meta.get(Keys.Tokenizer.PRE, "default")
    if pre not in BPE_PRE_TOKENIZERS:
        raise DSparkError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))})."
        )
    vocab = first_ids(tokens)
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab:
            raise DSparkError(
                f"GGUF tokenizer merge {merge!r} does not name two vocabulary tokens."
            )
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _bpe_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(
    tokens: list[str], scores: np.ndarray, types: np.ndarray
) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best-scoring
    merged piece first."""
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    ranked = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], mergeable[left], mergeable[right]))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def _sentencepiece_bpe(
    meta: dict[str, Any], tokens: list[str], types: np.ndarray
) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = meta.get(Keys.Tokenizer.SCORES)
    if scores is None or len(scores) != len(tokens):
        raise DSparkError(
            "the GGUF SentencePiece vocabulary has no tokenizer.ggml.scores "
            "of the same length as its tokens."
        )
    unk = meta.get(Keys.Tokenizer.UNK_ID)
    prefix = bool(meta.get(Keys.Tokenizer.ADD_PREFIX, True))
    tok = Tokenizer(
        models.BPE(
            vocab=first_ids(tokens),
            merges=sentencepiece_merges(tokens, np.asarray(scores), types),
            unk_token=None if unk is None else tokens[int(unk)],
            fuse_unk=True,
            byte_fallback=bool((types == TokenType.BYTE).any()),
        )
    )
    # llama.cpp (and SentencePiece) never split the text at spaces before
    # merging, and add the prefix space once, at the start of the text.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def first_ids(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def tokenizer_files(
    meta: dict[str, Any], vocab_rows: int, context_length: int | None = None
) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json (file
    name -> text) from the GGUF tokenizer metadata."""
    from tokenizers import AddedToken, processors

    kind = meta.get(Keys.Tokenizer.MODEL)
    tokens = meta.get(Keys.Tokenizer.LIST)
    if not isinstance(tokens, list) or not tokens:
        raise DSparkError("the GGUF metadata has no tokenizer.ggml.tokens list.")
    if len(tokens) > vocab_rows:
        raise DSparkError(
            f"the GGUF vocabulary has {len(tokens)} tokens but token_embd.weight "
            f"has only {vocab_rows} rows."
        )
    types = meta.get(Keys.Tokenizer.TOKEN_TYPE)
    types = (
        np.full(len(tokens), TokenType.NORMAL) if types is None else np.asarray(types)
    )
    if len(types) != len(tokens):
        raise DSparkError(
            "GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length."
        )
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise DSparkError(
            f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece) vocabularies can be "
            "converted."
        )

    special = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED)
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i in np.flatnonzero(np.isin(types, special))
        ]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i in np.flatnonzero(types == TokenType.USER_DEFINED)
        ]
    )

    def token(key: str) -> str | None:
        idx = meta.get(key)
        if idx is None:
            return None
        if not 0 <= int(idx) < len(tokens):
            raise DSparkError(f"GGUF {key} {idx} is out of range.")
        return tokens[int(idx)]

    bos, eos = token(Keys.Tokenizer.BOS_ID), token(Keys.Tokenizer.EOS_ID)
    add_bos = bool(meta.get(Keys.Tokenizer.ADD_BOS, False)) and bos is not None
    add_eos = bool(meta.get(Keys.Tokenizer.ADD_EOS, False)) and eos is not None
    if add_bos or add_eos:
        ids = first_ids(tokens)
        head, tail = [bos] * add_bos, [eos] * add_eos
        single = [*head, "$A", *tail]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single),
            pair=" ".join([*single, *head, "$B:1", *tail]),
            special_tokens=[(t, ids[t]) for t in {*head, *tail}],
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special_map = {
        name: value
        for name, value in (
            ("bos_token", bos),
            ("eos_token", eos),
            ("unk_token", token(Keys.Tokenizer.UNK_ID)),
            ("pad_token", token(Keys.Tokenizer.PAD_ID)),
        )
        if value is not None
    }
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        **special_map,
    }
    if context_length is not None:
        tok_config["model_max_length"] = context_length
    template = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)
    if isinstance(template, str):
        tok_config["chat_template"] = template
    return {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tok_config, indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(
            special_map, indent=2, ensure_ascii=False
        ),
    }
