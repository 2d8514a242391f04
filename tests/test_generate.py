"""model.generate / model.chat: streaming text, stop conditions, logprobs, stats, cancellation, and reply parsing
(reasoning, Qwen3.5 XML tool calls), on the tiny fixture."""
import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import qwenmetal as qm
from qwenmetal.chat import ChatStreamParser, parse_assistant, parse_tool_calls, prompt_opens_thinking, reply_events_merged
from qwenmetal.generation import StopStringMatcher
from qwenmetal.sampling import SampleResult
from model_runs import uncached_reference_model
from qwenmetal.testing import SPECIAL_TOKENS, make_checkpoint
from qwenmetal.tokenizer import _BYTE_DECODER

IM_END, ENDOFTEXT = SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return uncached_reference_model(tmp_path_factory.mktemp("g") / "ck")


class Script:
    """A sampler stand-in that emits a fixed token sequence (then repeats the last one)."""

    def __init__(self, tokens):
        self.tokens, self.i = list(tokens), 0

    def sample(self, logits, vocab_used=None, **kw):
        t = self.tokens[min(self.i, len(self.tokens) - 1)]
        self.i += 1
        return SampleResult(t)


def byte_ids(tok, data: bytes):
    inv = {b: c for c, b in _BYTE_DECODER.items()}
    return [tok.token_to_id(inv[b]) for b in data]


# ---- stop strings -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab<>|x\n", max_size=30), stop=st.lists(st.text(alphabet="ab<>|", min_size=1, max_size=4),
                                                                     min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_across_any_split(text, stop, cuts):
    pieces, prev = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        pieces.append(text[prev:c])
        prev = c
    m = StopStringMatcher(stop)
    out, hit = "", None
    for p in pieces:
        o, hit = m.push(p)
        out += o
        if hit is not None:
            break
    if hit is None:
        out += m.flush()
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if hits:
        _, i, s = min(hits)                  # the earliest end, then the earliest start
        assert out == text[:i] and hit == s
    else:
        assert out == text and hit is None


@pytest.mark.parametrize("stops, pieces, want", [
    ([], ["ab", "c"], [("ab", None), ("c", None)]),                # no stop strings: text passes through
    (["", "b"], ["ab"], [("a", "b")]),                              # an empty stop string is ignored
    (["cd", "ab"], ["abcd"], [("", "ab")]),                         # the earliest end wins ...
    (["bcd", "cd"], ["abcd"], [("a", "bcd")]),                      # ... then the earliest start
    (["cd", "bcd"], ["abcd"], [("a", "bcd")]),
    (["ab"], ["xa", "c"], [("x", None), ("ac", None)]),             # a possible start is held back, then released
    (["abc"], ["xab", "c"], [("x", None), ("", "abc")]),            # held across tokens, then matched
    (["aab"], ["aa", "ab"], [("", None), ("a", "aab")]),
    (["abc"], ["xa", "bc"], [("x", None), ("", "abc")]),            # every possible length of held start is tried
    (["ab", "xyz"], ["qxy", "z!"], [("q", None), ("", "xyz")]),     # the longest hold over all stop strings
    (["xyz", "ab"], ["qxy", "a"], [("q", None), ("xy", None)]),
    (["abc"], ["a", "b", "x"], [("", None), ("", None), ("abx", None)]),
])
def test_stop_matcher_cases(stops, pieces, want):
    m = StopStringMatcher(stops)
    assert [m.push(p) for p in pieces] == want


def test_stop_matcher_flush_releases_what_is_held():
    m = StopStringMatcher(["abc"])
    assert m.push("xab") == ("x", None) and m.flush() == "ab" and m.flush() == ""
    assert m.push("c") == ("c", None)                             # nothing is held after a flush
    assert m.push("abc") == ("", "abc") and m.flush() == "" and m.push("x") == ("x", None)   # nor after a match


def test_generate_with_stop_string_and_stop_ids(model):
    free = list(model.generate("The quick brown fox", max_tokens=20, temperature=0, ignore_eos=True))
    text = "".join(o.text for o in free)
    assert free[-1].finish_reason == "length" and len(free) == 20
    stop = text[7:10]
    outs = list(model.generate("The quick brown fox", max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))
    got = "".join(o.text for o in outs)
    assert got == text[:text.index(stop)] and outs[-1].finish_reason == "stop" and outs[-1].stop == stop
    assert [o.token for o in outs] == [o.token for o in free[:len(outs)]]
    # a stop token id ends generation at that token, whose text is not emitted
    k = 5
    sid = free[k].token
    first = next(j for j, o in enumerate(free) if o.token == sid)
    outs = list(model.generate("The quick brown fox", max_tokens=20, temperature=0, ignore_eos=True,
                               stop_token_ids=[sid]))
    assert len(outs) == first + 1 and outs[-1].finish_reason == "stop" and outs[-1].stop == sid
    assert outs[-1].text == ""


def test_text_held_for_a_stop_string_is_released_at_any_other_end(model):
    """Text held back as the possible start of a stop string is emitted with the last output when generation
    ends otherwise: at a stop token id, at max_tokens, at the context limit."""
    tok = model.tokenizer
    ids = byte_ids(tok, b"xa")                                     # "a" could start the stop string "ab"
    p = len(tok.encode("hi"))
    runs = {"stop": dict(sampler=Script(ids + [IM_END]), max_tokens=10),
            "length": dict(sampler=Script(ids), max_tokens=2),
            "context": dict(sampler=Script(ids + [7] * 5), max_tokens=10, session=model.new_session(max_context=p + 1))}
    for reason, kw in runs.items():
        outs = list(model.generate("hi", stop=["ab"], **kw))
        texts = [o.text for o in outs]
        assert texts == (["x", "", "a"] if reason == "stop" else ["x", "a"]), reason
        assert outs[-1].finish_reason == reason and all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].stop == (IM_END if reason == "stop" else None)
        assert outs[-1].stats["generated_tokens"] == len(outs) and [o.index for o in outs] == list(range(len(outs)))
    plain = list(model.generate("hi", stop=["ab"], sampler=Script(byte_ids(tok, b"xy")), max_tokens=2))
    assert [o.text for o in plain] == ["x", "y"]                 # the last token's own text, nothing held
    cut = byte_ids(tok, "🙂".encode())[:2]                         # completed only by the final flush
    assert [o.text for o in model.generate("hi", stop=["\ufffd"], sampler=Script(cut), max_tokens=2)] == ["", ""]


def test_the_sampler_sees_prompt_and_generated_tokens(model):
    seen = []

    class Recording(Script):
        def sample(self, logits, vocab_used=None, **kw):
            seen.append((list(kw["context"]), list(kw["generated"])))
            return super().sample(logits, vocab_used, **kw)

    ids = model.tokenizer.encode("hi there")
    list(model.generate(ids, sampler=Recording([5, 6, 7]), max_tokens=3))
    assert seen == [(ids, []), (ids + [5], [5]), (ids + [5, 6], [5, 6])]
    outs = list(model.generate(ids, max_tokens=2, temperature=0, logprobs=True, ignore_eos=True))
    assert all(o.logprob is not None and o.logprob <= 0 and not o.top_logprobs for o in outs)


def test_special_tokens_are_left_out_of_the_text_unless_asked(model):
    script = [ENDOFTEXT] + model.tokenizer.encode("ab")
    kw = dict(max_tokens=3, ignore_eos=True)
    assert "".join(o.text for o in model.generate("hi", sampler=Script(script), **kw)) == "ab"
    assert "".join(o.text for o in model.generate("hi", sampler=Script(script), skip_special_tokens=False,
                                                  **kw)) == "<|endoftext|>ab"


def test_token_ids_without_a_tokenizer(tmp_path):
    d = make_checkpoint(tmp_path / "ck", "tiny", "mlx-q4", seed=4)
    (d / "tokenizer.json").unlink()
    m = qm.Model.load(d, backend="reference")
    outs = list(m.generate([1, 2, 3], sampler=Script([5, 6]), max_tokens=2, ignore_eos=True))
    assert [o.token for o in outs] == [5, 6] and [o.text for o in outs] == ["", ""]
    assert outs[-1].finish_reason == "length"
    outs = list(m.generate([1, 2, 3], sampler=Script([5, 6, 7]), max_tokens=5, stop_token_ids=[6]))
    assert [o.text for o in outs] == ["", ""] and outs[-1].finish_reason == "stop" and outs[-1].stop == 6


def test_eos_ids_and_im_end(model):
    assert IM_END in model.eos_token_ids and ENDOFTEXT in model.eos_token_ids
    a = model.tokenizer.encode("ab")
    outs = list(model.generate("hi", sampler=Script(a + [IM_END, 7, 7]), max_tokens=10))
    assert [o.token for o in outs] == a + [IM_END] and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == "ab" and outs[-1].stop == IM_END
    outs = list(model.generate("hi", sampler=Script(a + [ENDOFTEXT, 7]), max_tokens=10, ignore_eos=True))
    assert len(outs) == 10 and outs[-1].finish_reason == "length"


def test_streaming_never_splits_a_character(model):
    tok = model.tokenizer
    data = "🙂中é".encode()
    ids = byte_ids(tok, data)
    outs = list(model.generate("x", sampler=Script(ids + [IM_END]), max_tokens=20))
    texts = [o.text for o in outs]
    assert texts[:4] == ["", "", "", "🙂"] and texts[4:7] == ["", "", "中"] and texts[7:9] == ["", "é"]
    assert "".join(texts) == "🙂中é" and not any("\ufffd" in t for t in texts)
    # cut in the middle of a character by max_tokens: the incomplete end becomes U+FFFD, as decode() gives
    outs = list(model.generate("x", sampler=Script(ids), max_tokens=2))
    assert "".join(o.text for o in outs) == tok.decode(ids[:2]) == "\ufffd"
    outs = list(model.generate("x", sampler=Script(ids[:2] + [IM_END]), max_tokens=20))   # ... or by a stop id
    assert [o.text for o in outs] == ["", "", "\ufffd"] and outs[-1].stop == IM_END


def test_length_context_stats_and_logprobs(model):
    ids = model.tokenizer.encode("Hello there")
    s = model.new_session(max_context=len(ids) + 3)
    outs = list(model.generate(ids, max_tokens=50, temperature=0, session=s, ignore_eos=True, logprobs=True,
                               top_logprobs=3))
    assert len(outs) == 4 and outs[-1].finish_reason == "context" and s.position == len(ids) + 3
    st_ = outs[-1].stats
    for k in ("prompt_tokens", "cached_tokens", "prefill_tokens", "generated_tokens", "prefill_tokens_per_second",
              "decode_tokens_per_second", "prefill_seconds", "decode_seconds", "time_to_first_token"):
        assert k in st_
    assert st_["prompt_tokens"] == len(ids) and st_["generated_tokens"] == 4 and st_["cached_tokens"] == 0
    # logprobs: log_softmax of the logits a manual prefill/decode gives
    m = model.new_session()
    logits = model.prefill(m, ids)
    V = model.tokenizer.vocab_size
    for o in outs:
        x = logits[:V].astype(np.float64)
        ref = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        assert o.token == int(np.argmax(x)) and o.logprob == pytest.approx(ref[o.token], abs=1e-6)
        assert [i for i, _ in o.top_logprobs][0] == o.token and len(o.top_logprobs) == 3
        if o.finish_reason is None:
            logits = model.decode_step(m, o.token)
    assert "GenerationOutput(token=" in repr(outs[0])


def test_generate_validates_before_running(model):
    s = model.new_session(max_context=8)
    model.prefill(s, [1, 2, 3])
    for kw in (dict(max_tokens=0), dict(stop=[3]), dict(temperature=-1), dict(top_p=2.0), dict(top_logprobs=-1)):
        (name, _), = kw.items()
        with pytest.raises(ValueError, match=f"^{name} must"):
            model.generate("abc", session=s, **kw)
    with pytest.raises(ValueError, match="context overflow"):
        model.generate(list(range(10)), session=s)
    with pytest.raises(ValueError, match="non-empty"):
        model.generate("abc", session=s, stop=["x", ""])
    with pytest.raises(ValueError, match="either a sampler or sampling options.*temperature"):
        model.generate("abc", session=s, sampler=qm.Sampler(temperature=0.5), temperature=0.7)
    assert s.position == 3


def test_defaults_come_from_generation_config(model):
    # generation_config.json: temperature 1.0, top_k 20, top_p 0.95 -> sampled, and seeded
    a = [o.token for o in model.generate("abc", max_tokens=8, seed=1, ignore_eos=True)]
    b = [o.token for o in model.generate("abc", max_tokens=8, seed=1, ignore_eos=True)]
    g = [o.token for o in model.generate("abc", max_tokens=8, temperature=0, ignore_eos=True)]
    assert a == b and a != g


def test_cancel_and_progress(model, capsys):
    ev = threading.Event()
    outs = []
    for o in model.generate("abc", max_tokens=30, temperature=0, ignore_eos=True, cancel=ev, progress=True):
        outs.append(o)
        if len(outs) == 3:
            ev.set()
    assert len(outs) == 3 and outs[-1].finish_reason is None
    assert "prefill" in capsys.readouterr().err          # the tqdm bar


# ---- chat ---------------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
REPLY = ("I should call the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
         "Berlin\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_parse_assistant_and_tool_calls():
    r, c, calls = parse_assistant(REPLY, thinking=True, tools=TOOLS)
    assert r == "I should call the tool." and c == "Let me check."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Berlin", "days": 3}}]
    assert parse_tool_calls("<tool_call>\n<function=f>\n<parameter=x>\n[1, 2]\n</parameter>\n<parameter=y>\n007\n"
                            "</parameter>\n</function>\n</tool_call>") == [{"name": "f", "arguments": {"x": [1, 2], "y": "007"}}]
    assert parse_assistant("plain answer", thinking=False) == (None, "plain answer", [])
    assert parse_assistant("still thinking", thinking=True) == ("still thinking", "", [])
    assert parse_assistant("<think>\nhm\n</think>\n\nyes") == ("hm", "yes", [])
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _stream(p: ChatStreamParser, text: str, cuts) -> tuple[dict, list]:
    """Feed `text` to the parser in the pieces `cuts` makes: (the fields it streamed, the tool calls). Each
    call's argument pieces concatenate to the JSON of its arguments."""
    events = []
    prev = 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        events += p.feed(text[prev:c])
        prev = c
    events += p.finish()
    r, c, calls = reply_events_merged(events)
    args: dict = {}
    for e in events:
        if e[0] == "tool_args":
            args[e[1]] = args.get(e[1], "") + e[2]
    assert [json.loads(args[k]) for k in sorted(args)] == [c_["arguments"] for c_ in calls]
    assert [e[2] for e in events if e[0] == "tool_call"] == [c_["name"] for c_ in calls]
    return {"reasoning_content": r, "content": c}, calls


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, len(REPLY)), max_size=12))
def test_stream_parser_agrees_with_parse_assistant(cuts):
    p = ChatStreamParser(thinking=True, tools=TOOLS)
    fields, calls = _stream(p, REPLY, cuts)
    r, c, want = parse_assistant(REPLY, thinking=True, tools=TOOLS)
    assert fields["reasoning_content"].strip() == r and fields["content"].strip() == c and calls == want


PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "\n\n", " ", "a", "ok.", "<", "</", "think", ">",
          "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"]


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=14), cuts=st.lists(st.integers(0, 80), max_size=10),
       thinking=st.booleans(), parse_tools=st.booleans())
def test_a_reply_splits_the_same_streamed_in_any_pieces_or_whole(pieces, cuts, thinking, parse_tools):
    """The server streams a reply through ChatStreamParser and answers a non-streamed request with
    parse_assistant: for any text (think tags, stray ones, newlines) and any cut into pieces both give
    the same reasoning and content (up to the whitespace the whole-text form strips)."""
    text = "".join(pieces)
    p = ChatStreamParser(thinking, None, parse_tools=parse_tools)
    fields, calls = _stream(p, text, cuts)
    r, c, want_calls = parse_assistant(text, thinking=thinking, parse_tools=parse_tools)
    assert (fields["reasoning_content"].strip(), fields["content"].strip(), calls) == (r or "", c, want_calls)
    assert (r is not None) == p.opened_thinking


def test_with_thinking_off_a_stray_close_tag_is_content():
    """enable_thinking=false: the template closed an empty think block in the prompt, so the reply is
    content, a '</think>' in it included; with thinking on the text before it is the reasoning."""
    assert parse_assistant("So: 4</think> is the answer", thinking=False) == (None, "So: 4</think> is the answer", [])
    assert parse_assistant("So: 4</think> is the answer", thinking=True) == ("So: 4", "is the answer", [])
    # a reply that opens its own block is still split, newlines before it or not
    assert parse_assistant("\n<think>hm</think>\n\nyes", thinking=False) == ("hm", "yes", [])


def test_chat_end_to_end_with_a_scripted_reply(model):
    tok = model.tokenizer
    msgs = [{"role": "user", "content": "Weather in Berlin?"}]
    r = model.chat(msgs, tools=TOOLS, sampler=Script(tok.encode(REPLY) + [IM_END]), max_tokens=200)
    assert isinstance(r, qm.ChatResponse) and r.finish_reason == "stop"
    assert r.reasoning == "I should call the tool." and r.content == "Let me check."
    assert r.tool_calls == [{"name": "get_weather", "arguments": {"city": "Berlin", "days": 3}}]
    # the reply goes back into the conversation and renders with the tool result
    msgs2 = msgs + [r.message, {"role": "tool", "content": '{"temp": 21}'}]
    text = tok.apply_chat_template(msgs2, tools=TOOLS)
    assert "<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>" in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    assert str(r) == "Let me check." and "get\\_weather" in r._repr_markdown_()


def test_chat_real_generation_and_stream(model):
    msgs = [{"role": "user", "content": "Hello!"}]
    r = model.chat(msgs, max_tokens=6, temperature=0, enable_thinking=False)
    outs = list(model.chat(msgs, max_tokens=6, temperature=0, enable_thinking=False, stream=True))
    assert [o.token for o in outs] == r.tokens
    assert r.reasoning is None and r.content == "".join(o.text for o in outs).strip()
    ids, head, text = model.chat_prompt(msgs, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and 0 < head < len(ids)
    assert r.stats["prompt_tokens"] == len(ids)


def test_notebook_reprs(model):
    html = model._repr_html_()
    assert "qwenmetal.Model" in html and "Gated DeltaNet" in html and "qwenmetal.ModelConfig" in html
    s = model.new_session()
    model.prefill(s, model.tokenizer.encode("hello <world>"))
    h = s._repr_html_()
    assert "qwenmetal.Session" in h and "&lt;world&gt;" in h          # escaped
    assert "Session(position=" in repr(s) and "ModelConfig(" in repr(model.config)


def test_markdown_repr_escapes_model_text():
    """Generated text shows as written in a notebook: no HTML, links, emphasis or headings from the model."""
    evil = "<img src=x onerror=alert(1)> **bold** [link](http://e.vil) # head\n<script>x</script> a & b `c` \\"
    r = qm.ChatResponse(text="", content=evil, reasoning="<b>think</b> _x_", tool_calls=[
        {"name": "f<i>", "arguments": {"q": "*y*"}}], finish_reason="stop",
        stats={"prompt_tokens": 1, "cached_tokens": 0, "generated_tokens": 2}, tokens=[])
    md = r._repr_markdown_()
    for raw in ("<img", "<script", "<b>", "<i>", "**bold**", "[link](", "_x_", "*y*", "`c`", " & "):
        assert raw not in md, raw
    assert "&lt;img src\\=x" in md and "\\*\\*bold\\*\\*" in md and "\\[link\\]" in md and "a &amp; b" in md
    assert md.startswith("> &lt;b&gt;think") and "<small>1 prompt tokens" in md     # our own markup stays
    from qwenmetal.chat import markdown_escape
    assert markdown_escape("plain text 123\nline two") == "plain text 123\nline two"


def test_one_chat_turn_parses_tool_calls_only_when_tools_are_offered(model):
    from qwenmetal.chat import chat_turn
    msgs = [{"role": "user", "content": "Weather in Berlin?"}]
    with_tools = chat_turn(model, msgs, tools=TOOLS)
    plain = chat_turn(model, msgs)
    assert with_tools.parse(REPLY)[2] and plain.parse(REPLY)[2] == []
    assert "<tool_call>" in plain.parse(REPLY)[1]
    for turn in (with_tools, plain):           # the streamed split is the same as the whole-text one
        p = turn.stream_parser()
        _, content, calls = reply_events_merged(p.feed(REPLY) + p.finish())
        assert (content.strip(), calls) == turn.parse(REPLY)[1:]
    assert 0 < plain.cache_point < len(plain.prompt_ids) and plain.cache_points == (plain.cache_point,)
