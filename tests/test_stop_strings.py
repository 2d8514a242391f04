"""Stop strings end to end (model.generate on the tiny fixture, greedy): a stop string strictly inside one
token's text, one that is a whole token, one at a token's end, and one straddling two tokens each end the
generation at the token that completes them, emit exactly the text before the stop string and no token
after it. The positions are chosen from the fixture's own greedy output, so the test holds for any
fixture that produces a token of 3+ characters followed by a non-empty one."""
import pytest

from model_runs import uncached_reference_model

PROMPT = "The quick brown fox"
N = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return uncached_reference_model(tmp_path_factory.mktemp("stop") / "ck")


@pytest.fixture(scope="module")
def free(model):
    """The greedy run without stop strings: its per-token texts."""
    outs = list(model.generate(PROMPT, max_tokens=N, temperature=0, ignore_eos=True))
    assert len(outs) == N and outs[-1].finish_reason == "length"
    return outs


def run(model, stop):
    return list(model.generate(PROMPT, max_tokens=N, temperature=0, ignore_eos=True, stop=stop))


def check(model, free, stop, last, start):
    """Generation with ``stop`` ends at token ``last`` and emits the text before ``start``."""
    text = "".join(o.text for o in free)
    assert text.find(stop) == start, "the chosen stop string must first occur there"
    outs = run(model, [stop])
    assert [o.token for o in outs] == [o.token for o in free[:last + 1]]
    assert "".join(o.text for o in outs) == text[:start]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop == stop
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].stats["generated_tokens"] == last + 1


def offsets(free):
    out, pos = [], 0
    for o in free:
        out.append(pos)
        pos += len(o.text)
    return out


def plain(t):
    """Ordinary text: letters and spaces (not a control byte, a replacement character or a tag token)."""
    return len(t) > 0 and t.replace(" ", "").isalpha()


def pick(free, ok):
    """The first token index j for which ``ok(j, text, offset)`` gives a (stop, start) that occurs first there."""
    text = "".join(o.text for o in free)
    for j, at in enumerate(offsets(free)):
        r = ok(j, free[j].text, at)
        if r is not None and text.find(r[0]) == r[1]:
            return j, r[0], r[1]
    pytest.fail(f"the fixture's greedy output has no token that fits: {[o.text for o in free]}")


def test_stop_string_inside_one_token(model, free):
    j, stop, start = pick(free, lambda j, t, at: (t[1:-1], at + 1) if len(t) >= 3 and plain(t[1:-1]) else None)
    assert 0 < start - offsets(free)[j] and start + len(stop) < offsets(free)[j] + len(free[j].text)
    check(model, free, stop, j, start)


def test_stop_string_is_a_whole_token_or_its_end(model, free):
    j, stop, start = pick(free, lambda j, t, at: (t, at) if len(t) >= 2 and plain(t) else None)
    check(model, free, stop, j, start)
    j, stop, start = pick(free, lambda j, t, at: (t[1:], at + 1) if len(t) >= 3 and plain(t[1:]) else None)
    check(model, free, stop, j, start)


def test_stop_string_straddling_tokens(model, free):
    def straddle(j, t, at):
        if j + 1 < len(free) and plain(t) and plain(free[j + 1].text):
            return t[-2:] + free[j + 1].text[:2], at + len(t) - len(t[-2:])
        return None
    j, stop, start = pick(free, straddle)
    check(model, free, stop, j + 1, start)
    # of two stop strings the one that is complete first ends the generation
    text = "".join(o.text for o in free)
    later = text[start + 1:start + len(stop) + 3]            # starts after `stop`, ends after it
    assert text.find(later) == start + 1 and len(later) == len(stop) + 2
    outs = run(model, [later, stop])
    assert outs[-1].stop == stop and len(outs) == j + 2
