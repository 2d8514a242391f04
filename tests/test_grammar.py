"""Structured output (qwenmetal.grammar): the token mask in the sampler, JSON Schema output that validates on
every backend with and without speculative decoding, drafts that break the grammar rejected, chat replies
whose tool calls follow the tools' schemas, clear errors for bad schemas, and the thinking budget (its forced
note and close, on every backend, with a grammar too) -- on the tiny fixture."""
import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.chat import ChatStreamParser, chat_turn, parse_tool_calls, reply_events_merged
from qwenmetal.grammar import BUDGET_NOTE, Grammar, GrammarError, ThinkingBudget, reply_grammar, thinking_budget
from qwenmetal.speculative import Drafter
from qwenmetal.testing import cached_checkpoint

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "n", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def models():
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    return {b: qm.Model.load(path, backend=b) for b in ("reference", "cpu", "metal-sim")}


def _text(outs) -> str:
    return "".join(o.text for o in outs)


# ---- JSON Schema output on every backend ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "cpu", "metal-sim"])
def test_json_schema_output_validates_with_and_without_speculation(models, backend):
    m = models[backend]
    g = Grammar.json_schema(SCHEMA)
    plain = list(m.generate("Describe a thing as JSON:", max_tokens=80, temperature=0, grammar=g, cache=False))
    assert plain[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(_text(plain)), SCHEMA)
    spec = list(m.generate("Describe a thing as JSON:", max_tokens=80, temperature=0, grammar=g, cache=False,
                           speculative="lookup"))
    assert [o.token for o in spec] == [o.token for o in plain]
    sampled = list(m.generate("Describe a thing as JSON:", max_tokens=80, temperature=1.0, seed=5, grammar=g))
    if sampled[-1].finish_reason == "stop":
        jsonschema.validate(json.loads(_text(sampled)), SCHEMA)


class _Fixed(Drafter):
    """Drafts the continuation of `tokens` after the context's generated part (a deterministic oracle)."""

    name = "fixed"

    def __init__(self, prompt_len: int, tokens):
        self.n, self.tokens = prompt_len, list(tokens)

    def draft(self, context, k):
        done = len(context) - self.n
        return self.tokens[done:done + k]


def test_drafts_that_break_the_grammar_are_rejected(models):
    """A drafter proposing the unconstrained reply (which breaks the schema at once) and one proposing the
    constrained reply itself both give the constrained tokens; the second has its drafts accepted."""
    m = models["cpu"]
    g = Grammar.json_schema(SCHEMA)
    prompt = m.tokenizer.encode("Describe a thing as JSON:")
    want = [o.token for o in m.generate(prompt, max_tokens=60, temperature=0, grammar=g, cache=False)]
    free = [o.token for o in m.generate(prompt, max_tokens=60, temperature=0, cache=False, ignore_eos=True)]
    assert free[:len(want)] != want
    for tokens, accepted in ((free, False), (want, True)):
        outs = list(m.generate(prompt, max_tokens=60, temperature=0, grammar=g, cache=False,
                               speculative=_Fixed(len(prompt), tokens), speculative_k=4))
        assert [o.token for o in outs] == want
        assert (outs[-1].stats["speculative"]["accepted_tokens"] > 0) == accepted


def test_bad_grammars_are_refused_before_any_work(models):
    m = models["reference"]
    s = m.new_session()
    with pytest.raises(GrammarError, match="Invalid type") as e:
        Grammar.json_schema({"type": "nonsense"})
    assert e.value.param == "schema"
    with pytest.raises(GrammarError, match="response_format"):
        reply_grammar(thinking=False, answer_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
    with pytest.raises(GrammarError, match="'missing'.*not among the tools") as e:
        reply_grammar(thinking=False, tools=[WEATHER], tool_choice="missing")
    assert e.value.param == "tool_choice"
    with pytest.raises(GrammarError, match="needs tools"):
        reply_grammar(thinking=False, tool_choice="required")
    with pytest.raises(GrammarError, match="two tools are named"):
        reply_grammar(thinking=False, tools=[WEATHER, WEATHER])
    with pytest.raises(qm.InputError, match="grammar must be a qwenmetal.Grammar"):
        m.generate("x", grammar={"type": "object"}, session=s)
    with pytest.raises(GrammarError, match="unknown name"):
        Grammar.lark("start: foo")
    assert s.position == 0
    assert reply_grammar(thinking=False, tools=[WEATHER], tool_choice="none") is None
    assert Grammar.regex("[0-9]{3}").description == "a regular expression"


def test_a_regex_and_a_lark_grammar(models):
    m = models["reference"]
    out = _text(m.generate("Code:", max_tokens=10, temperature=0, grammar=Grammar.regex("[A-Z]{3}-[0-9]{2}")))
    assert len(out) == 6 and out[:3].isupper() and out[3] == "-" and out[4:].isdigit()
    g = Grammar.lark('start: "yes" | "no"')
    assert _text(m.generate("Answer:", max_tokens=5, temperature=0, grammar=g)) in ("yes", "no")


# ---- chat replies: tool calls follow the tools' schemas -----------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "metal-sim"])
def test_forced_tool_calls_parse_and_follow_their_schemas(models, backend):
    m = models[backend]
    msgs = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    params = WEATHER["function"]["parameters"]
    if backend == "reference":                 # (metal-sim: the named call below, on the GPU sampling path)
        r = m.chat(msgs, tools=[WEATHER, NOOP], tool_choice="required", enable_thinking=False, max_tokens=120,
                   temperature=0)
        assert r.finish_reason == "stop" and r.tool_calls, r.text
        for c in r.tool_calls:
            assert c["name"] in ("get_weather", "noop")
            if c["name"] == "get_weather":
                jsonschema.validate(c["arguments"], params)
    one = m.chat(msgs, tools=[WEATHER, NOOP], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False, enable_thinking=False, max_tokens=120, temperature=0)
    assert [c["name"] for c in one.tool_calls] == ["get_weather"]
    jsonschema.validate(one.tool_calls[0]["arguments"], params)
    if backend != "reference":
        return
    js = m.chat(msgs, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
                enable_thinking=False, max_tokens=80, temperature=0)
    jsonschema.validate(json.loads(js.content), SCHEMA)


def test_a_thinking_reply_closes_its_think_block_before_the_answer(models):
    m = models["reference"]
    turn = chat_turn(m, [{"role": "user", "content": "hi"}], enable_thinking=True,
                     response_format={"type": "json_object"})
    assert turn.thinking
    matcher = turn.grammar.matcher(m)
    tok = m.tokenizer
    for t in tok.encode("let me think") + [tok.token_to_id("</think>")] + tok.encode('\n\n{"a": 1}'):
        assert matcher.allowed()[t]
        matcher.advance(t)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert not matcher.accepting and matcher.allowed()[im_end] and not matcher.allowed()[eot]   # the turn's end
    matcher.advance(im_end)
    assert matcher.accepting
    bad = turn.grammar.matcher(m)
    for t in tok.encode("hm") + [tok.token_to_id("</think>")]:
        bad.advance(t)
    assert not bad.allowed()[tok.encode("x")[0]]          # after the think block: JSON only


def test_malformed_tool_call_text_is_content():
    tools = [WEATHER]
    for text in ("<tool_call>\nnot a function\n</tool_call>", "<tool_call><function=get_weather>\n<oops>"):
        p = ChatStreamParser(False, tools)
        r, c, calls = reply_events_merged(p.feed(text) + p.finish())
        assert "<" in c and (calls == [] or calls == [{"name": "get_weather", "arguments": {}}])
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2"
    assert parse_tool_calls(cut, tools) == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    two = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n</tool_call>\n"
           "<tool_call>\n<function=noop>\n</function>\n</tool_call>")
    p = ChatStreamParser(False, tools)
    events = p.feed(two) + p.finish()
    assert [e[:2] for e in events if e[0] == "tool_call"] == [("tool_call", 0), ("tool_call", 1)]
    assert "".join(e[2] for e in events if e[0] == "tool_args" and e[1] == 0) == '{"city": "A"}'
    assert "".join(e[2] for e in events if e[0] == "tool_args" and e[1] == 1) == "{}"


def test_batched_rows_each_follow_their_own_grammar(models):
    """A batch decodes rows under different grammars (and one without): each row gives what it gives alone.
    (Batched rows are sampled on the host on every backend: cpu stands for all.)"""
    m = models["cpu"]
    prompts = ["Describe a thing as JSON:", "Code:", "Tell me a story."]
    opts = [qm.GenerationOptions(max_tokens=40, temperature=0, grammar=Grammar.json_schema(SCHEMA)),
            qm.GenerationOptions(max_tokens=40, temperature=0, grammar=Grammar.regex("[A-Z]{3}-[0-9]{2}")),
            qm.GenerationOptions(max_tokens=12, temperature=0, ignore_eos=True)]
    got = {i: [] for i in range(3)}
    for i, o in m.generate_batch(prompts, options=opts, cache=False):
        got[i].append(o.token)
    for i in range(3):
        alone = [o.token for o in m.generate(prompts[i], options=opts[i], cache=False)]
        assert got[i] == alone
    jsonschema.validate(json.loads(m.tokenizer.decode(got[0][:-1])), SCHEMA)


def test_matchers_of_one_grammar_are_independent(models):
    """A grammar is compiled once per tokenizer and each generation gets a copy: advancing one matcher leaves
    the next one at the start."""
    m = models["reference"]
    g = Grammar.regex("a[bc]{2}")
    first, second = g.matcher(m), g.matcher(m)
    start = second.allowed().copy()
    for t in m.tokenizer.encode("ab"):
        first.advance(t)
    assert (second.allowed() == start).all() and (g.matcher(m).allowed() == start).all()
    assert not (first.allowed() == start).all()


# ---- the thinking budget ----------------------------------------------------------------------------------------
def test_a_thinking_budget_forces_its_note_and_the_close_then_frees_the_reply():
    """ThinkingBudget over made-up ids (note 5 6 7, ``</think>`` 9, 40 ids): free tokens, then each forced one,
    a wrong token refused with the state untouched, rollback across the forcing, a natural close, budgets
    shorter than the note."""
    b = ThinkingBudget(None, [5, 6, 7], 9, 5, 40)
    assert b.free_steps() == 2 and b.allowed() is None
    for t in (1, 2):
        b.advance(t)
    assert b.free_steps() == 0 and list(np.flatnonzero(b.allowed())) == [5] and b.bitmask()[0] == 1 << 5
    with pytest.raises(GrammarError, match="forces token 5"):
        b.advance(6)
    for t in (5, 6, 7, 9):
        assert b.allowed()[t]
        b.advance(t)
    assert b.closed and b.thought == 5 and b.allowed() is None and b.free_steps() > 10**9
    assert list(b.bitmask()) == [0xFFFFFFFF, 0xFF]             # every id of the 40
    b.rollback(3)                                               # back before 6 7 9
    assert not b.closed and list(np.flatnonzero(b.allowed(20))) == [6]
    with pytest.raises(GrammarError, match="cannot roll"):
        b.rollback(4)
    natural = ThinkingBudget(None, [5, 6, 7], 9, 5, 40)
    natural.advance(1)
    natural.advance(9)
    assert natural.closed and natural.allowed() is None
    short = ThinkingBudget(None, [5, 6, 7], 9, 2, 40)          # no room for the note: the close alone
    short.advance(1)
    short.advance(2)
    assert list(np.flatnonzero(short.allowed())) == [9]
    assert list(np.flatnonzero(ThinkingBudget(None, [5], 9, 0, 40).allowed())) == [9]


def test_the_budget_applies_only_inside_an_open_think_block(models):
    m = models["reference"]
    tok = m.tokenizer
    think, close = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert isinstance(thinking_budget(m, [1, think, 2], 8), ThinkingBudget)
    assert thinking_budget(m, [1, think, 2, close, 3], 8) is None and thinking_budget(m, [1, 2], 8) is None
    g = Grammar.regex("[a-z]+").matcher(m)
    assert thinking_budget(m, [1, 2], 8, g) is g
    with pytest.raises(qm.InputError, match="no tokenizer.json, so thinking cannot be bounded"):
        thinking_budget(SimpleNamespace(tokenizer=None, path="x"), [1], 8)
    with pytest.raises(qm.InputError, match="thinking_budget must be an integer >= 0"):
        qm.GenerationOptions(thinking_budget=-1)
    plain = [o.token for o in m.generate("Hello", max_tokens=6, temperature=0, cache=False)]
    assert [o.token for o in m.generate("Hello", max_tokens=6, temperature=0, cache=False,
                                        thinking_budget=0)] == plain


@pytest.mark.parametrize("backend", ["reference", "cpu", "metal-sim"])
def test_thinking_stops_at_its_budget_on_every_backend(models, backend, monkeypatch):
    """A thinking turn of the tiny model (which never closes its think block by itself) thinks exactly
    `budget` tokens, the last of them the note, then ``</think>``; speculation gives the same tokens. On
    metal-sim with a budget shorter than the note, the GPU decode loop runs unmasked, several tokens per
    call, until the close is forced."""
    m = models[backend]
    tok = m.tokenizer
    prompt = chat_turn(m, [{"role": "user", "content": "hi"}], enable_thinking=True).prompt_ids
    close, note = tok.token_to_id("</think>"), tok.encode(BUDGET_NOTE)
    budget = len(note) + 4 if backend != "metal-sim" else 8
    calls = []
    if backend == "metal-sim":
        loop = m.decode_loop

        def recorded(s, t, n, **kw):
            calls.append((n, "mask" in kw))
            return loop(s, t, n, **kw)
        monkeypatch.setattr(m, "decode_loop", recorded)
    toks = [o.token for o in m.generate(prompt, max_tokens=budget + 3, temperature=0, ignore_eos=True,
                                        cache=False, thinking_budget=budget)]
    assert toks.index(close) == budget
    if backend == "metal-sim":
        assert calls[0] == (budget - 1, False) and (1, True) in calls   # free run-ahead, then the forced close
    else:
        assert toks[budget - len(note):budget] == note
    if backend != "reference":
        assert [o.token for o in m.generate(prompt, max_tokens=budget + 3, temperature=0, ignore_eos=True,
                                            cache=False, thinking_budget=budget, speculative="lookup")] == toks


def test_a_bounded_thinking_reply_still_follows_its_schema(models):
    m = models["cpu"]
    budget = len(m.tokenizer.encode(BUDGET_NOTE)) + 2
    r = m.chat([{"role": "user", "content": "Describe a thing as JSON."}], enable_thinking=True,
               response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
               thinking_budget=budget, max_tokens=budget + 80, temperature=0)
    assert r.finish_reason == "stop" and r.reasoning.endswith(BUDGET_NOTE.strip())
    jsonschema.validate(json.loads(r.content), SCHEMA)
