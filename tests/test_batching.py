"""Many sessions at once (qwenmetal.session.decode_batch, qwenmetal.batching): a batched step's rows are bit for
bit their sessions' own decode steps, and a batched generation gives every prompt what it gets alone, with rows
joining and leaving, prompts prefilled in pieces between steps, cancellations, failures and interrupts
contained to their rows."""
import threading

import numpy as np
import pytest
import qwenmetal as qm
from qwenmetal import session as ses
from qwenmetal.batching import Batcher
from qwenmetal.generation import prepare
from qwenmetal.prefix_cache import PrefixCache
from qwenmetal.testing import cached_checkpoint

_models: dict = {}


def _load(preset="tiny", fmt="mlx-q4", backend="cpu", **kw):
    key = (preset, fmt, backend, tuple(sorted(kw.items())))
    if key not in _models:
        if backend == "cpu":
            kw = {"threads": 2, "prefill_chunk": 16, **kw}
        _models[key] = qm.Model.load(cached_checkpoint(preset, fmt), backend=backend, **kw)
    return _models[key]


def _prompts(rng, lengths=(3, 40, 17, 70, 9)):
    return [[int(t) for t in rng.integers(0, 500, n)] for n in lengths]


def _state(model, s):
    return model._backend.state_to_arrays(s._state)


def _same(model, a, b):
    x, y = _state(model, a), _state(model, b)
    return a.tokens == b.tokens and x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


# ---- the batched step -----------------------------------------------------------------------------
def _check_rows_are_decode_steps(m, seed=0, steps=8):
    """Sessions of different lengths; each step runs a random subset of them (rows join and leave): every row
    bit for bit the session's own decode step, and the sessions end as the ones decoded alone."""
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng)
    alone, batch = [], []
    for p in prompts:
        a, b = m.new_session(), m.new_session()
        m.prefill(a, p)
        m.prefill(b, p)
        alone.append(a)
        batch.append(b)
    for _ in range(steps):
        rows = [i for i in range(len(prompts)) if rng.random() < 0.7] or [int(rng.integers(len(prompts)))]
        rng.shuffle(rows)
        toks = [int(rng.integers(0, m.config.vocab_size)) for _ in rows]
        got = ses.decode_batch(m, [batch[i] for i in rows], toks)
        assert got.shape == (len(rows), m.config.vocab_size) and got.dtype == np.float32
        for j, i in enumerate(rows):
            np.testing.assert_array_equal(got[j], m.decode_step(alone[i], toks[j]))
    for a, b in zip(alone, batch):
        assert _same(m, a, b)


@pytest.mark.parametrize("preset,fmt,activations", [("tiny", "mlx-q4", "int16"), ("tiny-qwen3-next", "mlx-q4", "int16"),
                                                    ("tiny", "hf-bf16", "float"), ("tiny", "mlx-q8", "int16"),
                                                    ("tiny-qwen3-next", "mlx-q4", "float")])
def test_cpu_batched_rows_are_decode_steps(preset, fmt, activations):
    m = _load(preset, fmt, activations=activations, kv_dtype="float32")
    assert m.max_batch_rows == 16                 # min(32, prefill_chunk)
    _check_rows_are_decode_steps(m)


def test_streamed_experts_batch_bit_for_bit():
    """With the routed experts streamed from disk through a small cache, the union of the rows' experts is
    read in batches of slots: still every row its own decode step."""
    _check_rows_are_decode_steps(_load(expert_slots=3, kv_dtype="float32"), seed=3, steps=4)


def test_reference_runs_rows_one_by_one():
    m = _load(backend="reference")
    assert m.max_batch_rows is None
    _check_rows_are_decode_steps(m, steps=3)


def test_decode_batch_errors_leave_every_session_alone():
    m = _load()
    a, b = m.new_session(), m.new_session(max_context=3)
    m.prefill(a, [1, 2, 3])
    m.prefill(b, [4, 5, 6])
    ref_a, ref_b = a.fork(), b.fork()
    other = _load("tiny-qwen3-next").new_session()
    bad = [
        (([a, a], [1, 2]), "appears twice"),
        (([a, b], [1]), "2 sessions but 1 token ids"),
        (([a, b], [1, m.config.vocab_size]), "outside the vocabulary"),
        (([a, b], [1, 2]), "context overflow"),             # b is full
        (([a, other], [1, 2]), "another model"),
        (([], []), "at least one session"),
        (([a], [1.5]), "one integer token id"),
        (([a] + [m.new_session() for _ in range(16)], [1] * 17), "at most 16 sessions"),
    ]
    for (sessions, ids), msg in bad:
        with pytest.raises(ValueError, match=msg):
            ses.decode_batch(m, sessions, ids)
        assert _same(m, a, ref_a) and _same(m, b, ref_b)


def test_a_failing_row_by_row_step_leaves_every_session_alone(monkeypatch):
    """The row-by-row path (the reference) is all-or-nothing too: a failure or a Ctrl-C at the second row
    puts the first row's session back."""
    m = _load(backend="reference")
    ss = [m.new_session() for _ in range(3)]
    for i, s in enumerate(ss):
        m.prefill(s, [i + 1, i + 2])
    refs = [s.fork() for s in ss]
    real = m._backend.forward
    for exc in (RuntimeError("device lost"), KeyboardInterrupt()):
        calls = []

        def forward(state, ids, logits, consumed=None):
            calls.append(1)
            if len(calls) == 2:
                raise exc
            return real(state, ids, logits, consumed)

        monkeypatch.setattr(m._backend, "forward", forward)
        with pytest.raises(type(exc), match="device lost|^$"):
            ses.decode_batch(m, ss, [7, 8, 9])
        assert all(_same(m, s, r) for s, r in zip(ss, refs))


# ---- batched generation ----------------------------------------------------------------------------
def _options():
    o = qm.GenerationOptions
    return [o(max_tokens=20, temperature=0, ignore_eos=True),
            o(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
            o(max_tokens=25, temperature=1.0, top_p=0.9, seed=7, logprobs=True, ignore_eos=True),
            o(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3),
            o(max_tokens=30, temperature=0.5, seed=1, repetition_penalty=1.3, stop_token_ids=(33,))]


def _outputs(gen):
    return [(o.token, o.text, o.logprob, o.top_logprobs, o.finish_reason) for o in gen]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_generate_batch_gives_each_prompt_what_it_gets_alone(preset):
    """Five prompts of different lengths and options (greedy, seeded sampling, top-p, penalties, logprobs,
    stop ids) on 3 rows, prompts prefilled in pieces of 32 between decode steps: each prompt's outputs are the
    ones `generate` gives it alone."""
    m = _load(preset)
    prompts, opts = _prompts(np.random.default_rng(1)), _options()
    alone = [_outputs(m.generate(p, options=o, cache=False)) for p, o in zip(prompts, opts)]
    got = {i: [] for i in range(len(prompts))}
    order = []
    for i, out in m.generate_batch(prompts, options=opts, cache=False, max_rows=3, step_tokens=32):
        got[i].extend(_outputs([out]))
        order.append(i)
    assert [got[i] for i in range(len(prompts))] == alone
    assert len(set(order[:6])) > 1                 # interleaved, not one after another


@pytest.mark.parametrize("seed", [0, 1])
def test_generations_added_between_steps(seed):
    """Generations join at random steps while others run (as the server adds requests), on the hf-bf16
    fixture: each still gives what it gives alone."""
    m = _load("tiny", "hf-bf16")
    rng = np.random.default_rng(seed)
    prompts, opts = _prompts(rng), _options()
    alone = [_outputs(m.generate(p, options=o, cache=False)) for p, o in zip(prompts, opts)]
    b = Batcher(m, max_rows=4, step_tokens=int(rng.integers(8, 64)))
    todo = list(range(len(prompts)))
    got = {i: [] for i in todo}
    while todo or b.active:
        if todo and rng.random() < 0.4:
            i = todo.pop(0)
            b.add(prepare(m, prompts[i], opts[i], cache=False), i)
        for ev in b.step():
            assert ev.kind == "out"
            got[ev.tag].extend(_outputs([ev.value]))
    assert [got[i] for i in range(len(prompts))] == alone


def test_generate_batch_on_the_metal_graph(preset="tiny"):
    """metal-sim (float32): the batched steps run in the Metal graph (GpuEngine.decode_batch, the union-read
    MoE); every prompt gets what it gets alone -- greedy through the GPU decode loop, seeded sampling on the
    host path (logprobs on). Both architectures' batched steps: tests/test_batch_metal.py."""
    m = _load(preset, backend="metal-sim", dtype="float32")
    assert m.max_batch_rows == 16
    prompts = _prompts(np.random.default_rng(5), (3, 21, 9))
    o = qm.GenerationOptions
    opts = [o(max_tokens=10, temperature=0, ignore_eos=True),
            o(max_tokens=8, temperature=0.8, seed=2, logprobs=True, ignore_eos=True),
            o(max_tokens=12, temperature=0, ignore_eos=True)]
    alone = [[x.token for x in m.generate(p, options=q, cache=False)] for p, q in zip(prompts, opts)]
    got = {i: [] for i in range(3)}
    for i, out in m.generate_batch(prompts, options=opts, cache=False, max_rows=2):
        got[i].append(out.token)
    assert [got[i] for i in range(3)] == alone


def test_generate_batch_with_stop_strings_and_keywords():
    m = _load()
    prompts = ["hello world", "the cat", "a b c d e f"]
    kw = dict(max_tokens=24, temperature=0.7, seed=3, stop=["e", "at"])
    alone = [_outputs(m.generate(p, cache=False, **kw)) for p in prompts]
    got = {i: [] for i in range(3)}
    for i, out in m.generate_batch(prompts, cache=False, **kw):
        got[i].extend(_outputs([out]))
    assert [got[i] for i in range(3)] == alone


def test_generate_batch_checks_everything_first():
    m = _load()
    with pytest.raises(ValueError, match=r"prompts\[1\]: token id"):
        m.generate_batch([[1, 2], [1, 10**9]])
    with pytest.raises(ValueError, match="2 prompts but 1 options"):
        m.generate_batch([[1], [2]], options=[qm.GenerationOptions()])
    with pytest.raises(ValueError, match="at least one prompt"):
        m.generate_batch([])
    with pytest.raises(ValueError, match="at most 16 rows"):
        m.generate_batch([[1]], max_rows=17)
    with pytest.raises(TypeError, match="unknown generation option"):
        m.generate_batch([[1]], temprature=1.0)


def _batch(m, prompts, opts, **kw):
    b = Batcher(m, **kw)
    gens = []
    for i, (p, o) in enumerate(zip(prompts, opts)):
        g = prepare(m, p, o, cache=False, cancel=threading.Event())
        gens.append(g)
        b.add(g, i)
    return b, gens


def test_a_cancelled_or_failing_row_leaves_the_others_unchanged():
    m = _load()
    prompts, opts = _prompts(np.random.default_rng(2)), _options()
    alone = [_outputs(m.generate(p, options=o, cache=False)) for p, o in zip(prompts, opts)]
    b, gens = _batch(m, prompts, opts, max_rows=4, step_tokens=32)

    class Broken(qm.Sampler):
        def sample(self, *a, **k):
            raise RuntimeError("sampler broke")

    gens[3].run.sampler = Broken()                 # fails at its first token
    got = {i: [] for i in range(len(prompts))}
    ended = {}
    while b.active:
        for ev in b.step():
            if ev.kind == "out":
                got[ev.tag].extend(_outputs([ev.value]))
                if ev.tag == 1 and len(got[1]) == 4:
                    gens[1].run.cancel.set()       # its client left
            else:
                ended[ev.tag] = ev.kind
    assert ended == {1: "cancelled", 3: "error"}
    assert got[1] == alone[1][:4] and got[3] == []
    for i in (0, 2, 4):
        assert got[i] == alone[i]
    assert b.stats.steps > 0 and max(b.stats.history) <= 4


def test_an_interrupt_leaves_every_session_whole():
    """A Ctrl-C inside a batched step: every session holds as many tokens as its state has consumed."""
    m = _load()
    prompts = _prompts(np.random.default_rng(3))
    b, gens = _batch(m, prompts, [qm.GenerationOptions(max_tokens=20, ignore_eos=True)] * 5, step_tokens=32)
    real = m._backend.decode_batch
    calls = []

    def decode_batch(states, ids, consumed=None):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(states, ids, consumed)

    m._backend.decode_batch = decode_batch
    try:
        with pytest.raises(KeyboardInterrupt, match="^$"):
            while b.active:
                b.step()
    finally:
        del m._backend.decode_batch
    for g in gens:
        assert len(g.session.tokens) == g.session.position


def test_concurrent_prompts_share_the_prefix_cache():
    """Two requests with a common 80-token prefix, submitted together: the second starts after the first's
    pieces and restores the snapshot the first left at a chunk boundary."""
    m = _load()
    saved = m.prefix_cache
    m.prefix_cache = PrefixCache(chunk_tokens=32)
    try:
        head = [int(t) for t in np.random.default_rng(4).integers(0, 500, 80)]
        prompts = [head + [1, 2, 3], head + [7, 8]]
        o = qm.GenerationOptions(max_tokens=4, temperature=0, ignore_eos=True)
        stats = {}
        for i, out in m.generate_batch(prompts, options=o, step_tokens=32):
            if out.stats:
                stats[i] = out.stats
        assert stats[0]["cached_tokens"] == 0 and stats[1]["cached_tokens"] >= 64
        for i, p in enumerate(prompts):
            alone = [x.token for x in m.generate(p, options=o, cache=False)]
            got = [x.token for j, x in m.generate_batch([p], options=o, cache=False) if j == 0]
            assert got == alone
    finally:
        m.prefix_cache = saved
