"""The MTP head native in the Metal graph (`GpuMtpHead`, `GpuEngine.mtp_draft`; docs/metal.md, "The MTP head") on
metal-sim: every draft step's logits against `ReferenceMtp` (float32 tight, bfloat16 against the reference's
bfloat16 mode, loose) for a one- and a two-layer head, a round as one command buffer, bad input refused with the
state untouched, and ``speculative="mtp"`` natively on metal-sim giving the plain greedy output."""
import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.backends.metal import GpuMtpHead
from qwenmetal.backends.reference import ReferenceModel, ReferenceMtp
from qwenmetal.mtp import MtpDrafter
from qwenmetal.testing import cached_checkpoint
from qwenmetal.weights import to_float32
from test_mtp import _drafts_from_scratch, reference_round, two_layer_head

pytestmark = pytest.mark.skipif("metal-sim" not in qm.backends.BACKENDS, reason="needs the metal-sim backend")


@pytest.mark.parametrize("preset,layers,dtype", [("tiny", 1, "float32"), ("tiny", 2, "float32"),
                                                 ("tiny-qwen3-next", 2, "float32"), ("tiny", 1, "bfloat16"),
                                                 ("tiny", 2, "bfloat16")])
def test_metal_head_equals_the_reference(preset, layers, dtype):
    """Rounds of 4, 2 and 19 pairs with 5 drafts each: the drafts and every step's logits are ReferenceMtp's on the
    same weights (float32: within 1e-5 of the logits' range; bfloat16, against the reference's bfloat16 mode:
    within 1e-2, the chains equal up to a near tie), the pairs stay in the head's state, each round is one
    command buffer."""
    m = qm.Model.load(cached_checkpoint(preset, "mlx-q4", 0, mtp=True), backend="metal-sim", dtype=dtype)
    params = dict(m.weights.mtp) if layers == 1 else two_layer_head(m, preset)
    head = m._backend.mtp_head(params)
    assert isinstance(head, GpuMtpHead) and head.engine.is_mtp_head and head.n_layers == layers
    ref = ReferenceModel(m.config, m.weights.dense_float32(), dtype=dtype)
    rh = ReferenceMtp.from_model(ref, {k: to_float32(v) for k, v in params.items()})
    ids = np.random.default_rng(3).integers(0, 400, 26)
    fh = []
    ref.forward(ref.new_state(), ids, logits="none", final_hidden=fh)
    hid, nxt = np.ascontiguousarray(fh[0][:-1], dtype=np.float32), ids[1:]
    st, rs = head.new_state(), rh.new_state()
    tol = 1e-5 if dtype == "float32" else 1e-2
    for a, b in ((0, 4), (4, 6), (6, 25)):                     # the last: 19 pairs, two rows passes
        drafts, lg = head.draft(st, hid[a:b], nxt[a:b], 5, 0, return_logits=True)
        want, wl = reference_round(rh, rs, hid[a:b], nxt[a:b], 5)
        if dtype == "float32":
            assert drafts == want
        for j in range(5):                  # the chains agree up to a near tie (bf16 rounding decides it)
            assert np.abs(lg[j] - wl[j]).max() < tol * np.ptp(wl[j])
            if drafts[j] != want[j]:
                assert wl[j][want[j]] - wl[j][drafts[j]] < tol * np.ptp(wl[j])
                break
        assert st.position == rs.position == b and head.last_command_buffers == 1


def test_metal_head_backlog_of_pairs():
    """Pairs without drafts (k = 0: a prompt's) and more pairs than one call takes (fed ahead; the limit lowered
    to 32 here) leave the head where the reference is: the drafts over all 70 pairs are the reference's."""
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0, mtp=True), backend="metal-sim")
    head = m._backend.mtp_head(m.weights.mtp)
    head.MAX_PAIRS = 32
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    rh = ReferenceMtp.from_model(ref, {k: to_float32(v) for k, v in m.weights.mtp.items()})
    ids = np.random.default_rng(5).integers(0, 400, 71)
    fh = []
    ref.forward(ref.new_state(), ids, logits="none", final_hidden=fh)
    hid, nxt = fh[0][:-1], ids[1:]
    st, rs = head.new_state(), rh.new_state()
    assert head.draft(st, hid[:5], nxt[:5], 0, 0) == [] and st.position == 5
    assert head.draft(st, hid[5:], nxt[5:], 3, 0) == reference_round(rh, rs, hid, nxt, 3)[0]
    assert st.position == 70


def test_metal_head_bad_input_leaves_the_state():
    """Bad ids, a hidden array of the wrong width, and the main model's engine asked to draft are refused with the
    head's state untouched. (And the head binds its tensors in the main model's wrapped files: no new wrap.)"""
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0, mtp=True), backend="metal-sim")
    wrapped = m._backend.device.wrapped_bytes
    head = m._backend.mtp_head(m.weights.mtp)
    assert m._backend.device.wrapped_bytes == wrapped
    H = m.config.hidden_size
    st = head.new_state()
    head.draft(st, np.zeros((2, H), np.float32), np.asarray([1, 2]), 2, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        head.draft(st, np.zeros((2, H), np.float32), np.asarray([1, 10**6]), 2, 0)
    with pytest.raises(ValueError, match=r"hidden must be \[len\(ids\), hidden_size\]"):
        head.draft(st, np.zeros((2, H + 1), np.float32), np.asarray([1, 2]), 2, 0)
    with pytest.raises(ValueError, match="needs an MTP head's model"):
        m._backend.engine.mtp_draft(m._backend.new_state(), np.zeros((1, H), np.float32), np.asarray([1]), 1)
    assert st.position == 2


GREEDY = dict(max_tokens=16, temperature=0, ignore_eos=True, cache=False)


@pytest.fixture(scope="module")
def sim_plain():
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0, mtp=True), backend="metal-sim")
    return m, [o.token for o in m.generate("The quick brown fox", **GREEDY)]


@pytest.mark.parametrize("layers", [1, 2])
def test_speculative_mtp_native_on_metal_sim(sim_plain, layers):
    """speculative="mtp" on metal-sim runs the head in the graph (no reference session of the main model) with the
    verification's hidden rows, and gives the plain greedy output."""
    m, plain = sim_plain
    kw = GREEDY
    d = MtpDrafter.for_model(m) if layers == 1 else MtpDrafter(m, two_layer_head(m))
    spec = list(m.generate("The quick brown fox", speculative=d, speculative_k=3, **kw))
    assert [o.token for o in spec] == plain
    assert spec[-1].stats["speculative"]["drafted_tokens"] > 0
    assert d.wants_hidden and isinstance(d._native, GpuMtpHead) and d._native.n_layers == layers
    assert d._ref is None and d._main is None                   # nothing of the main model runs in numpy
    assert d._native.last_command_buffers == 1


def test_mtp_round_cost_encode_only():
    """encode_only_mtp_cost (GpuEngine.mtp_cost over the virtual MTP table, encode-only): a round is one command
    buffer; every draft adds the same dispatches and levels and at least the lm_head's bytes."""
    from qwenmetal.bench.cost import encode_only_mtp_cost
    from qwenmetal.config import ModelConfig
    from qwenmetal.testing import PRESETS
    c = ModelConfig.from_dict(PRESETS["tiny"])
    r = encode_only_mtp_cost(c, drafts=(1, 2, 3), pairs=3, n_layers=2, context=40)["rounds"]
    assert all(v["command_buffers"] == 1 for v in r.values())
    for key in ("dispatches", "levels"):
        assert r[3][key] - r[2][key] == r[2][key] - r[1][key] > 0, key
    H, V = c.hidden_size, c.vocab_size
    assert min(r[2]["bytes"] - r[1]["bytes"], r[3]["bytes"] - r[2]["bytes"]) > V * H // 2   # the lm_head, 4 bits
    with pytest.raises(ValueError, match="drafts 0..16 tokens, got 17"):
        encode_only_mtp_cost(c, drafts=(17,))
    from qwenmetal.bench.speculative import format_mtp_modelled
    lines = format_mtp_modelled(encode_only_mtp_cost(c, drafts=(1, 3), context=40))
    assert "MODELLED" in lines[0] and len(lines) == 5 and lines[3].split()[0] == "1"


@pytest.mark.parametrize("opts", [dict(prefill_chunk=4), dict(prefill_chunk=64), dict(expert_slots=4)])
def test_metal_forward_hidden(opts):
    """forward_hidden (the prefill's final-normed rows, an MTP head's input over a prompt) against the reference's
    final hidden states, in chunks of 4 (three chunks), in one, and in streaming mode (token by token); the
    logits are forward's; a one-token call gives the decode step's row."""
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0, mtp=True), backend="metal-sim", **opts)
    assert m.returns_hidden
    ids = np.random.default_rng(6).integers(0, 400, 10)
    ref = ReferenceModel(m.config, m.weights.dense_float32())
    fh = []
    ref.forward(ref.new_state(), ids, logits="none", final_hidden=fh)
    out, hid = m._backend.forward_hidden(m._backend.new_state(), ids, "last")
    assert hid.shape == (10, m.config.hidden_size) and np.abs(hid - fh[0]).max() < 1e-5 * np.ptp(fh[0])
    _, plain = m._backend.forward(m._backend.new_state(), ids, "last")
    np.testing.assert_array_equal(out, plain)
    _, one = m._backend.forward_hidden(m._backend.new_state(), ids[:1], "none")
    assert np.abs(one[0] - fh[0][0]).max() < 1e-5 * np.ptp(fh[0])


def test_metal_head_caches_the_prompt():
    """A generation's prompt prefill on metal-sim hands every row's hidden state to the native drafter
    (Speculation.prefill -> forward_hidden), so the first drafts are the formula's over the whole context."""
    from qwenmetal.speculative import Speculation
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", 0, mtp=True), backend="metal-sim")
    ctx = np.random.default_rng(4).integers(0, 400, 40).tolist()
    d = MtpDrafter.for_model(m)
    sp = Speculation(m, m.new_session(), d, None)
    sp.prefill(ctx[:-1], "last")
    assert d.draft(ctx, 3) == _drafts_from_scratch(m, ctx, 3)
    sp.close()
