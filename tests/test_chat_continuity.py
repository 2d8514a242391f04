"""Chat continuity: every turn of a chat reuses the whole previous conversation (prompt + reply, as the model
read and generated it) from the prefix cache, with thinking on and off, on the reference and cpu backends;
the answers are those of a run without the cache; a saved conversation (Model.chat_session, Session.load)
and a new process on the same on-disk cache (Model.use_disk_cache) continue with the cached state.

The fixture's random weights rarely end a reply, so replies are steered: greedy decoding with a large logit
bias on ``<|im_end|>`` once a reply has N tokens (N varies per turn) and, with thinking on, on ``</think>``
half way -- the reply's tokens are the model's own (greedy) up to that point, and they end the way a real
model's reply ends, which is what the transcripts rely on.

QWENMETAL_CHAT_TURNS=40 runs a longer chat (default: 10 turns on cpu, 5 on the reference backend).
"""
import io
import json
import os
import re

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.options import GenerationOptions
from qwenmetal.sampling import SampleResult, Sampler
from qwenmetal.testing import ENDOFTEXT, IM_END, SPECIAL_TOKENS, make_checkpoint
from qwenmetal.transcripts import TranscriptStore, conversation_keys, normalize_message

TURNS = int(os.environ.get("QWENMETAL_CHAT_TURNS", "0"))   # 0: 10 turns on cpu, 5 on the (slow) reference
THINK_END = SPECIAL_TOKENS["</think>"]


class Ending(Sampler):
    """Greedy; once the reply has `n` tokens a +1e4 logit bias on `end` ends it; with `think_at`, the same
    bias on ``</think>`` at that length closes the reasoning."""

    def __init__(self, n: int, think_at: int | None = None, end: int = IM_END):
        super().__init__(temperature=0.0)
        self.n, self.think_at, self.end = n, think_at, end

    def sample(self, logits, vocab_used=None, *, generated=(), **kw):
        x = np.array(logits, dtype=np.float32)
        if self.think_at is not None and len(generated) == self.think_at:
            x[THINK_END] += 1e4
        if len(generated) >= self.n:
            x[self.end] += 1e4
        return super().sample(x, vocab_used, generated=generated, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("chat") / "ck", "tiny", "mlx-q4", seed=5)


def load(ckpt, backend="cpu", cache=True):
    m = qm.Model.load(ckpt, backend=backend)
    if not cache:
        m.prefix_cache = None
    return m


def reply_length(i: int) -> int:
    return 3 + (i * 7) % 9


def converse(model, turns, enable_thinking, **chat_kw):
    """`turns` user messages, each answered; returns [(prompt ids, ChatResponse)] and the messages."""
    msgs = [{"role": "system", "content": "You are terse."}]
    out = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: what is {i} squared?"})
        n = reply_length(i)
        ids, _, _ = model.chat_prompt(msgs, enable_thinking=enable_thinking, **chat_kw)
        r = model.chat(msgs, enable_thinking=enable_thinking, max_tokens=32,
                       sampler=Ending(n, n // 2 if enable_thinking is not False else None),
                       chat_template_kwargs=chat_kw or None)
        assert r.finish_reason == "stop" and r.tokens[-1] == IM_END
        out.append((ids, r))
        msgs.append(r.message)
    return out, msgs


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("enable_thinking", [None, False], ids=["thinking", "no-thinking"])
def test_every_turn_reuses_the_whole_previous_turn(ckpt, backend, enable_thinking):
    turns = TURNS or (10 if backend == "cpu" else 5)
    on, _ = converse(load(ckpt, backend), turns, enable_thinking)
    off, _ = converse(load(ckpt, backend, cache=False), turns, enable_thinking)
    print(f"\n{backend}, thinking {'on' if enable_thinking is None else 'off'}: turn, prompt, cached, fraction")
    for i, ((ids, r), (ids_off, r_off)) in enumerate(zip(on, off)):
        st = r.stats
        print(f"  {i + 1:2d} {st['prompt_tokens']:5d} {st['cached_tokens']:5d} "
              f"{st['cached_tokens'] / st['prompt_tokens']:.3f}")
        # the cache changes the speed, not the prompt or the answer
        assert ids == ids_off and r.tokens == r_off.tokens and r.text == r_off.text
        assert st["prompt_tokens"] == len(ids) and r_off.stats["cached_tokens"] == 0
        assert st["prefill_tokens"] == st["prompt_tokens"] - st["cached_tokens"]
        if i == 0:
            continue
        prev_ids, prev = on[i - 1]
        seen = prev_ids + prev.tokens                 # what the model read and wrote in the previous turn
        assert ids[:len(seen)] == seen                # ... is where this prompt starts
        # all of it comes from the cache but the end token (sampled, never fed back)
        assert st["cached_tokens"] >= len(seen) - 1
        assert st["cached_tokens"] / st["prompt_tokens"] >= (len(seen) - 1) / len(ids)


class Script:
    """Emits fixed tokens (a reply with a tool call, say)."""

    def __init__(self, tokens):
        self.tokens, self.i = list(tokens), 0

    def sample(self, logits, vocab_used=None, **kw):
        self.i += 1
        return SampleResult(self.tokens[min(self.i - 1, len(self.tokens) - 1)])


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("enable_thinking", [None, False], ids=["thinking", "no-thinking"])
def test_tool_calls_and_results_continue_the_transcript(ckpt, enable_thinking):
    model = load(ckpt)
    tk = model.tokenizer
    call = ("Checking.\n</think>\n\n" if enable_thinking is None else "") + \
        "Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n</function>\n</tool_call>"
    msgs = [{"role": "user", "content": "Weather in Berlin?"}]
    prev = None
    for step in range(3):
        if step == 0:
            sampler = Script(tk.encode(call) + [IM_END])
        else:
            msgs.append({"role": "tool", "content": '{"t": 21}'} if step == 1 else {"role": "user", "content": "Thanks"})
            sampler = Ending(5, 2 if enable_thinking is None else None)
        r = model.chat(msgs, tools=TOOLS, enable_thinking=enable_thinking, sampler=sampler, max_tokens=64)
        if step == 0:
            assert r.tool_calls == [{"name": "get_weather", "arguments": {"city": "Berlin"}}]
        else:
            assert r.stats["cached_tokens"] == prev - 1
        prev = r.stats["prompt_tokens"] + r.stats["generated_tokens"]
        msgs.append(r.message)


def contains(seq, sub) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_reasoning_of_earlier_turns_stays_in_the_context(ckpt):
    model = load(ckpt)
    turns, msgs = converse(model, 3, None)
    nxt = msgs + [{"role": "user", "content": "next"}]
    ids, _, _ = model.chat_prompt(nxt)
    first = turns[0][1]
    assert first.reasoning is not None and first.text.count("</think>") == 1
    assert contains(ids, first.tokens)                # the first reply as generated, think block included
    stock = model.tokenizer.encode(model.tokenizer.apply_chat_template(nxt, preserve_thinking=False))
    assert not contains(stock, first.tokens)          # the template alone drops it


def test_preserve_thinking_false_renders_the_template_and_keeps_no_transcripts(ckpt):
    model = load(ckpt)
    turns, msgs = converse(model, 3, None, preserve_thinking=False)
    assert len(model.transcripts) == 0
    tk = model.tokenizer
    for i, (ids, r) in enumerate(turns):
        history = [m for m in msgs[:2 + 2 * i]]
        assert ids == tk.encode(tk.apply_chat_template(history, preserve_thinking=False))
        if i:                                         # the previous reply is re-read (rendered differently)
            prev_ids, prev = turns[i - 1]
            assert r.stats["cached_tokens"] < len(prev_ids) + len(prev.tokens) - 1


def test_a_streamed_chat_keeps_its_transcript_when_consumed(ckpt):
    model = load(ckpt)
    msgs = [{"role": "user", "content": "hi"}]
    outs = model.chat(msgs, sampler=Ending(3), max_tokens=8, stream=True)
    first = next(outs)
    assert len(model.transcripts) == 0 and first.finish_reason is None
    rest = list(outs)
    assert len(model.transcripts) == 1 and rest[-1].token == IM_END
    r = model.chat(msgs, sampler=Ending(3), max_tokens=8)            # the same reply, as a response
    nxt = msgs + [r.message, {"role": "user", "content": "and?"}]
    ids, _, _ = model.chat_prompt(nxt)
    assert ids[:r.stats["prompt_tokens"] + len(r.tokens)] == model.chat_prompt(msgs)[0] + r.tokens


def test_replies_that_do_not_end_on_their_end_token_have_no_transcript(ckpt):
    model = load(ckpt)
    msgs = [{"role": "user", "content": "hi"}]
    r = model.chat(msgs, max_tokens=4, sampler=Ending(100))              # ends by length
    assert r.finish_reason == "length" and len(model.transcripts) == 0
    other = SPECIAL_TOKENS["<tool_call>"]
    r = model.chat(msgs, max_tokens=8, sampler=Ending(3, end=other), stop_token_ids=[other])
    assert r.finish_reason == "stop" and len(model.transcripts) == 0      # ended by another stop id
    # an end id the template does not write after a reply: the transcript does not line up, so the next
    # prompt is the plain rendering ...
    r = model.chat(msgs, max_tokens=8, sampler=Ending(3, end=ENDOFTEXT))
    assert r.tokens[-1] == ENDOFTEXT and len(model.transcripts) == 1
    nxt = msgs + [r.message, {"role": "user", "content": "and?"}]
    ids, _, text = model.chat_prompt(nxt)
    assert ids == model.tokenizer.encode(text)
    # ... or, when an earlier reply has a transcript that lines up, that transcript + the rendering of the rest
    good = model.chat(nxt, max_tokens=8, sampler=Ending(3))
    later = nxt + [good.message, {"role": "user", "content": "more"}]
    bad = model.chat(later, max_tokens=8, sampler=Ending(3, end=ENDOFTEXT))
    last = later + [bad.message, {"role": "user", "content": "end"}]
    ids, _, text = model.chat_prompt(last)
    seen = model.chat_prompt(nxt)[0] + good.tokens
    assert ids[:len(seen)] == seen and ids != model.tokenizer.encode(text)
    r = model.chat(last, max_tokens=4, sampler=Ending(2))
    assert r.stats["cached_tokens"] >= len(seen) - 1


def test_a_template_that_renders_the_history_differently_falls_back(ckpt):
    model = load(ckpt)
    tk = model.tokenizer
    # a template whose first line counts the messages: the history before a reply renders differently
    # inside a longer conversation, so a transcript cannot be continued
    tk.chat_template = "{{- messages | length }}\n" + tk.chat_template
    tk._template = None
    msgs = [{"role": "user", "content": "hi"}]
    r = model.chat(msgs, max_tokens=8, sampler=Ending(3))
    assert len(model.transcripts) == 1
    ids, _, text = model.chat_prompt(msgs + [r.message, {"role": "user", "content": "and?"}])
    assert text.startswith("3<|im_start|>") and ids == tk.encode(text)


def test_a_reply_that_spells_its_end_token_falls_back(ckpt):
    model = load(ckpt)
    tk = model.tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a <|im_end|> b"}]
    transcript = tk.encode(tk.apply_chat_template(msgs[:1])) + tk.encode("a <|im_end|>")
    model.transcripts.put(conversation_keys(msgs)[-1], transcript)
    nxt = msgs + [{"role": "user", "content": "and?"}]
    ids, _, text = model.chat_prompt(nxt)
    assert ids == tk.encode(text) and ids[:len(transcript)] != transcript


def test_conversation_keys_normalise_what_clients_send_back(ckpt):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    a = [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": "ok", "reasoning_content": "hm", "tool_calls": [call]}]
    b = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
         {"role": "assistant", "content": "ok", "refusal": None, "annotations": [],
          "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": {"x": 1}}}]}]
    assert conversation_keys(a) == conversation_keys(b)
    assert conversation_keys(a, template_kwargs={"preserve_thinking": True}) == conversation_keys(a)
    assert conversation_keys(a, template_kwargs={"enable_thinking": None}) == conversation_keys(a)
    assert conversation_keys(a)[-1] != conversation_keys(a, template_kwargs={"enable_thinking": False})[-1]
    assert conversation_keys(a)[-1] != conversation_keys(a, tools=[{"type": "function"}])[-1]
    c = [a[0], dict(a[1], content="ok!")]
    keys, keys_c = conversation_keys(a), conversation_keys(c)
    assert keys[0] == keys_c[0] and keys[1] != keys_c[1]
    assert normalize_message({"role": "assistant", "content": None}) == {"role": "assistant", "content": ""}


def test_transcript_store_is_bounded():
    s = TranscriptStore(max_entries=3, max_tokens=10)
    for i in range(4):
        s.put(f"k{i}", [i, i])
    assert len(s) == 3 and s.get("k0") is None and s.get("k1") == [1, 1]
    s.put("big", list(range(6)))                      # 2 + 2 + 2 + 6 > 10: the least recently used go
    assert s.total_tokens <= 10 and s.get("big") == list(range(6)) and s.get("k2") is None
    s.put("too big", list(range(11)))
    assert s.get("too big") is None
    with pytest.raises(ValueError, match="max_entries and max_tokens must be >= 1"):
        TranscriptStore(max_entries=0)


# ---- saved conversations and restarts -----------------------------------------------------------------
def test_saved_conversation_continues_cached(ckpt, tmp_path):
    model = load(ckpt)
    turns, msgs = converse(model, 3, None)
    s = model.chat_session(msgs)
    last_ids, last = turns[-1]
    assert list(s.tokens) == last_ids + last.tokens   # the transcript, end token included
    assert s.metadata["chat"]["transcript"] is True
    s.save(tmp_path / "chat.safetensors")

    fresh = load(ckpt)                                # another process: empty caches
    loaded = qm.Session.load(tmp_path / "chat.safetensors", fresh)
    nxt = loaded.metadata["messages"] + [{"role": "user", "content": "And 10?"}]
    r = fresh.chat(nxt, sampler=Ending(4), max_tokens=16)
    assert r.stats["cached_tokens"] == loaded.position == len(s.tokens)
    again = model.chat(nxt, sampler=Ending(4), max_tokens=16)
    assert again.tokens == r.tokens and again.stats["prompt_tokens"] == r.stats["prompt_tokens"]


def test_saved_conversation_without_transcript_continues_from_its_rendering(ckpt, tmp_path):
    model = load(ckpt)
    msgs = [{"role": "user", "content": "hi"}]
    r = model.chat(msgs, sampler=Ending(100), max_tokens=6)            # ends by length: no transcript
    msgs.append(r.message)
    s = model.chat_session(msgs)
    assert s.metadata["chat"]["transcript"] is False
    assert list(s.tokens) == model.tokenizer.encode(model.tokenizer.apply_chat_template(msgs, add_generation_prompt=False))
    s.save(tmp_path / "chat.safetensors")
    fresh = load(ckpt)
    loaded = qm.Session.load(tmp_path / "chat.safetensors", fresh)
    assert len(fresh.transcripts) == 0 and len(fresh.prefix_cache) == 1
    r = fresh.chat(loaded.metadata["messages"] + [{"role": "user", "content": "and?"}], sampler=Ending(3), max_tokens=8)
    assert r.stats["cached_tokens"] == loaded.position
    n = len(fresh.prefix_cache)
    plain = fresh.new_session()                                     # a session without a conversation
    fresh.prefill(plain, [1, 2, 3], return_logits="none")
    plain.save(tmp_path / "plain.safetensors", metadata={"note": 1})
    qm.Session.load(tmp_path / "plain.safetensors", fresh)
    assert len(fresh.prefix_cache) == n                             # is not put into the caches


def test_a_new_process_on_the_same_disk_cache_continues(ckpt, tmp_path):
    model = load(ckpt)
    model.use_disk_cache(tmp_path / "prompt-cache")
    turns, msgs = converse(model, 3, None)
    model.prefix_cache.disk.flush()
    assert model.prefix_cache.disk.writes == 3

    fresh = load(ckpt)
    fresh.use_disk_cache(tmp_path / "prompt-cache")
    assert len(fresh.transcripts) == 3
    nxt = msgs + [{"role": "user", "content": "And 10?"}]
    r = fresh.chat(nxt, sampler=Ending(4), max_tokens=16)
    last_ids, last = turns[-1]
    assert r.stats["cached_tokens"] == len(last_ids) + len(last.tokens) - 1
    assert fresh.prefix_cache.disk.loads == 1
    again = model.chat(nxt, sampler=Ending(4), max_tokens=16)
    assert again.tokens == r.tokens and again.stats["prompt_tokens"] == r.stats["prompt_tokens"]


def test_disk_tier_is_bounded_and_skips_unreadable_files(ckpt, tmp_path):
    model = load(ckpt)
    d = tmp_path / "pc"
    disk = model.prefix_cache.attach_disk(model, d, max_bytes=1 << 30)
    s = model.new_session()
    entries = []
    for n in (5, 9, 13):
        model.prefill(s, list(range(10, 10 + n - s.position)), return_logits="none")
        model.prefix_cache.put(s.tokens, s.snapshot(), kind="turn")
        assert model.prefix_cache.persist(s.tokens, note=n)
        entries.append(s.tokens)
    disk.flush()
    sizes = sorted(p.stat().st_size for p in disk.directory.glob("*.safetensors"))
    assert len(sizes) == 3 and disk.nbytes == sum(sizes)
    (disk.directory / "garbage.safetensors").write_bytes(b"not a session")
    other = load(ckpt)
    tier = other.prefix_cache.attach_disk(other, d, max_bytes=sizes[1] + sizes[2])
    assert sorted(len(t) for t, _ in tier.entries()) == [5, 9, 13]
    e = other.prefix_cache.lookup(list(entries[1]) + [7])
    assert e.kind == "disk" and e.tokens == entries[1]
    # the restored state is the state: the same next-token logits as the session that wrote it
    probe = other.new_session()
    probe.restore(e.snapshot)
    ref = model.new_session()
    ref.restore(model.prefix_cache.lookup(list(entries[1]), need_logits=False).snapshot)
    np.testing.assert_allclose(other.decode_step(probe, 7), model.decode_step(ref, 7), rtol=0, atol=0)
    # a file removed by another process is a miss, not an error
    for p in tier.directory.glob("*.safetensors"):
        p.unlink()
    other.prefix_cache.clear()
    assert other.prefix_cache.lookup(list(entries[2]) + [7]) is None
    # writes beyond the budget remove the least recently used files
    for t in entries:
        tier.save(t, model.prefix_cache.lookup(list(t), need_logits=False).snapshot)
    tier.flush()
    assert tier.nbytes <= tier.max_bytes and len(list(tier.directory.glob("*.safetensors"))) == 2
    with pytest.raises(ValueError, match="disk cache size must be a positive number of bytes"):
        model.prefix_cache.attach_disk(model, d, max_bytes=0)


# ---- the chat command and the server ------------------------------------------------------------------
@pytest.fixture
def steered(monkeypatch):
    """Replies of the CLI and the server end on <|im_end|> after 4 tokens (their sampler comes from
    GenerationOptions.sampler)."""
    monkeypatch.setattr(GenerationOptions, "sampler", lambda self, generation_config=None: Ending(4))


def chat_command(ckpt, monkeypatch, capsys, script: str) -> str:
    from qwenmetal.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["chat", "--model", str(ckpt), "--backend", "cpu", "--max-tokens", "16"]) == 0
    return capsys.readouterr().out


def test_chat_command_save_load_continues_cached(ckpt, tmp_path, monkeypatch, capsys, steered):
    f = tmp_path / "conv.safetensors"
    out = chat_command(ckpt, monkeypatch, capsys, f"Hello\nHow are you?\n/stats\n/save {f}\n/exit\n")
    prompt, cached = map(int, re.search(r"prompt (\d+) tokens \((\d+) cached\)", out).groups())
    saved = int(re.search(r"\(saved 4 messages, (\d+) tokens", out).group(1))
    assert cached > 0 and saved == prompt + 4 + 1        # the second turn's prompt + its reply (4 + end token)
    out = chat_command(ckpt, monkeypatch, capsys, f"/load {f}\nAnd now?\n/stats\n/exit\n")
    assert f"(loaded 4 messages, {saved} tokens)" in out
    prompt, cached = map(int, re.search(r"prompt (\d+) tokens \((\d+) cached\)", out).groups())
    assert cached == saved < prompt                      # a new process: everything up to the last turn cached


def test_a_restarted_server_continues_conversations_cached(ckpt, tmp_path, steered, require):
    require("starlette")
    require("httpx")
    from starlette.testclient import TestClient

    from qwenmetal.server import create_app

    def server():
        m = load(ckpt)
        m.use_disk_cache(tmp_path / "prompt-cache")
        return m, TestClient(create_app(m, model_name="tiny"))     # `with` runs its lifespan (the worker)

    def ask(client, msgs, stream=False):
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 16, "stream": stream,
                                                      "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        if not stream:
            body = r.json()
            return body["choices"][0]["message"], body["usage"]
        msg, usage = {"role": "assistant", "content": ""}, None
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                usage = ev.get("usage") or usage
                for ch in ev["choices"]:
                    msg["content"] += ch["delta"].get("content") or ""
        return msg, usage

    model, app = server()
    msgs, usages = [], []
    with app as client:
        for i, stream in enumerate([False, True, False]):
            msgs.append({"role": "user", "content": f"Question {i}?"})
            msg, usage = ask(client, msgs, stream)
            msgs.append({"role": "assistant", "content": msg["content"]})      # reasoning dropped, as clients do
            usages.append(usage)
    for prev, u in zip(usages, usages[1:]):     # non-streamed and streamed replies: the whole turn reused
        assert u["prompt_tokens_details"]["cached_tokens"] == prev["prompt_tokens"] + prev["completion_tokens"] - 1
    model.prefix_cache.disk.flush()

    _, app2 = server()                          # a restart: a new model and app on the same cache directory
    msgs.append({"role": "user", "content": "And now?"})
    with app2 as client:
        _, u = ask(client, msgs)
    last = usages[-1]
    assert u["prompt_tokens_details"]["cached_tokens"] == last["prompt_tokens"] + last["completion_tokens"] - 1
