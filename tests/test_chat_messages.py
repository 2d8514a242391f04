"""The one check of chat messages (`qwenmetal.chat.validate_messages`, used by Model.chat, the CLI and the
server), fuzzed with hypothesis: any JSON-like value either raises a ValueError naming ``messages...`` or
comes back as a normalised conversation that the chat template renders (or refuses with a ValueError
naming the template) -- never another exception, and the input is not modified.

CI runs a bounded number of examples; QWENMETAL_FUZZ_EXAMPLES=5000 runs more."""
import copy
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import qwenmetal as qm
from qwenmetal.chat import ROLES, validate_messages, validate_tools
from qwenmetal.errors import InputError
from qwenmetal.testing import cached_checkpoint
from qwenmetal.tokenizer import Tokenizer

EXAMPLES = int(os.environ.get("QWENMETAL_FUZZ_EXAMPLES", "150"))

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                          max_size=3), max_leaves=8)
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | json_values,
                               "text": st.text(max_size=10) | json_values})
calls = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.text(max_size=6) | json_values,
     "arguments": st.text(max_size=12) | st.dictionaries(st.text(max_size=4), json_values, max_size=2) | json_values})})
messages_like = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | st.sampled_from(["wizard", ""]) | json_values},
    optional={"content": st.text(max_size=20) | st.none() | st.lists(parts, max_size=3) | json_values,
              "tool_calls": st.lists(calls | json_values, max_size=2) | json_values,
              "reasoning_content": st.text(max_size=10) | json_values,
              "name": st.text(max_size=5) | json_values, "tool_call_id": st.text(max_size=5) | json_values})
conversations = json_values | st.lists(messages_like | json_values, max_size=5) | \
    st.lists(messages_like, min_size=1, max_size=5)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(cached_checkpoint("tiny", "mlx-q4"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=conversations)
def test_any_value_is_rejected_by_name_or_normalised(tok, value):
    before = copy.deepcopy(value)
    try:
        out = validate_messages(value)
    except InputError as e:
        assert isinstance(e, ValueError) and e.param.startswith("messages") and e.param in str(e)
        assert value == before
        return
    assert value == before                                    # the input is not modified
    assert isinstance(out, list) and out and len(out) == len(value)
    for m in out:
        assert m["role"] in ("system", "user", "assistant", "tool")
        c = m["content"]
        assert isinstance(c, str) or all(p["type"] == "text" and isinstance(p["text"], str) or
                                         m["role"] == "user" and p["type"] in ("image_url", "image") for p in c)
        for k in ("reasoning_content", "name", "tool_call_id"):
            assert m.get(k) is None or isinstance(m[k], str)
        for call in m.get("tool_calls") or []:
            assert isinstance(call["function"]["name"], str)
    assert validate_messages(out) == out                      # idempotent
    try:
        text = tok.apply_chat_template(out)
    except ValueError as e:                                   # the template refuses it (raise_exception)
        assert "chat template cannot render" in str(e)
        return
    assert isinstance(text, str) and "<|im_start|>assistant\n" in text.rsplit("<|im_end|>", 1)[-1]


def test_messages_errors_name_the_field():
    cases = [(None, "messages"), ([], "messages"), ("hi", "messages"), ([{"role": "wizard"}], "messages[0]"),
             ([{"role": "user", "content": "a"}, 3], "messages[1]"),
             ([{"role": "user", "content": 5}], "messages[0].content"),
             ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}], "messages[0].content"),
             ([{"role": "user", "content": [{"type": "image"}]}], "messages[0].content"),
             ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 1}}]}],
              "messages[0].tool_calls"),
             ([{"role": "tool", "content": "x", "tool_call_id": 7}], "messages[0].tool_call_id")]
    for value, param in cases:
        with pytest.raises(InputError, match=r"^" + param.replace("[", r"\[").replace("]", r"\]")) as e:
            validate_messages(value)
        assert e.value.param == param
    assert validate_messages([{"role": "developer", "content": None}]) == [{"role": "system", "content": ""}]


def test_model_chat_validates_as_the_server_does():
    model = qm.Model.load(cached_checkpoint("tiny", "mlx-q4"), backend="reference")
    with pytest.raises(ValueError, match=r"messages\[1\] must be an object with a role"):
        model.chat([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(ValueError, match="tools must be a list of objects"):
        model.chat([{"role": "user", "content": "hi"}], tools={"name": "f"}, max_tokens=2)


def test_each_message_field_is_checked_on_its_own():
    """Every check of validate_messages separately: a message using each field correctly passes unchanged, and
    each smallest wrong variant is refused naming the field, with its code and the offending value."""
    good = {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}],
            "reasoning_content": "r", "name": "n", "tool_call_id": "i",
            "tool_calls": [{"function": {"name": "f", "arguments": "{}"}},
                           {"function": {"name": "g", "arguments": {"x": 1}}}, {"function": {"name": "h"}}]}
    assert validate_messages([good]) == [good]
    text_part = "only text parts .* are supported, got "
    cases = [  # (field changed, its value, param, code, what the message says before the value, the value shown)
        ("content", [{"type": "text"}], "content", "unsupported_value", text_part, {"type": "text"}),
        ("content", [{"type": "text", "text": 3}], "content", "unsupported_value", text_part, {"type": "text", "text": 3}),
        ("content", [{"type": "image", "image": "a.png"}], "content", "unsupported_value",
         r"\[0\]: images go in user messages, not in assistant messages", None),
        ("content", [{"text": "a"}], "content", "unsupported_value", text_part, {"text": "a"}),
        ("content", ["a"], "content", "unsupported_value", text_part, "a"),
        ("content", 5, "content", "invalid_value", "must be a string or a list of text parts, got ", 5),
        ("reasoning_content", 3, "reasoning_content", "invalid_value", "must be a string, got ", 3),
        ("name", 4, "name", "invalid_value", "must be a string, got ", 4),
        ("tool_call_id", 5, "tool_call_id", "invalid_value", "must be a string, got ", 5),
        ("tool_calls", {"function": {"name": "f"}}, "tool_calls", "invalid_value", "must be a list, got ",
         {"function": {"name": "f"}}),
        ("tool_calls", ["f"], "tool_calls", "invalid_value", "must be an object with a 'function'.*got ", "f"),
        ("tool_calls", [{"name": "f"}], "tool_calls", "invalid_value", "must be an object with a 'function'.*got ",
         {"name": "f"}),
        ("tool_calls", [{"function": {"name": "f", "arguments": 3}}], "tool_calls", "invalid_value",
         "must be an object with a 'function'.*got ", {"function": {"name": "f", "arguments": 3}}),
    ]
    for key, value, param, code, says, shown in cases:
        m = dict(good, **{key: value})
        shown = "" if shown is None else re.escape(repr(shown))
        with pytest.raises(InputError, match=rf"^messages\[1\]\.{param}.*{says}{shown}$") as e:
            validate_messages([{"role": "user", "content": "hi"}, m])
        assert (e.value.param, e.value.code) == (f"messages[1].{param}", code)
    for value in ("hi", [{"role": "wizard"}]):          # the whole value, or the message, is shown
        with pytest.raises(InputError, match=f"got {re.escape(repr(value if value == 'hi' else value[0]))}$"):
            validate_messages(value)


def test_tools_are_none_or_a_list_of_objects():
    assert validate_tools(None) is None
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert validate_tools(tools) is tools and validate_tools([]) == []
    for bad in ({"name": "f"}, [{"name": "f"}, "g"], "f"):
        with pytest.raises(InputError, match=f"^tools must be a list of objects, got {re.escape(repr(bad))}$") as e:
            validate_tools(bad)
        assert e.value.param == "tools"


def test_long_values_are_cut_to_80_characters_in_messages():
    for n, shown in ((78, repr("a" * 78)), (79, repr("a" * 79)[:77] + "...")):   # a repr of 80 / 81 characters
        with pytest.raises(InputError, match="^tools must be") as e:
            validate_tools("a" * n)
        assert str(e.value) == "tools must be a list of objects, got " + shown and len(shown) == 80
