"""Interleaved M-RoPE (#34 part C, docs/vision.md "Positions and caches"): `qwenmetal.mrope.rope_index` against
transformers' ``get_rope_index``; the numpy reference with 3-D positions and embedding rows against transformers'
text model (random weights, random rows standing in for image features); the engines against the reference;
sessions (fork, snapshot, save/load) carrying the delta; prefix-cache keys on the images' content."""
import copy
import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import qwenmetal as qm
from oracles import require
from qwenmetal.config import ModelConfig
from qwenmetal.mrope import cache_key, image_digest, pair_positions, rope_index
from qwenmetal.testing import PRESETS

IMG = 200            # the image pad of the tests' shim config (inside the tiny vocabularies)


def shim(merge=2, **extra):
    """What rope_index reads of a config: config.json's image_token_id and vision_config."""
    return SimpleNamespace(raw={"image_token_id": IMG, "vision_config": {"spatial_merge_size": merge}, **extra})


def seq(*parts):
    """ids from parts: ints (text tokens) and (t, h, w) grids (an image's pads, merge 2)."""
    ids, grids, rng = [], [], np.random.default_rng(len(parts))
    for p in parts:
        if isinstance(p, tuple):
            grids.append(p)
            ids += [IMG] * (p[0] * (p[1] // 2) * (p[2] // 2))
        else:
            ids += [int(x) for x in rng.integers(1, 150, p)]
    return np.array(ids, np.int64), np.array(grids, np.int64).reshape(-1, 3)


def hf_rope_index(ids, grids, merge=2):
    torch = require("torch")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)))
    fake.get_vision_position_ids = functools.partial(Qwen3_5MoeModel.get_vision_position_ids, fake)
    t = torch.tensor(ids)[None]
    pos, delta = Qwen3_5MoeModel.get_rope_index(fake, t, (t == IMG).int(),
                                                image_grid_thw=torch.tensor(grids) if len(grids) else None)
    return pos[:, 0].numpy(), int(delta[0, 0])


SEQS = [(7,), (3, (1, 4, 6), 5), (2, (1, 8, 4), 3, (1, 4, 4), 4), ((1, 4, 6),), (4, (2, 4, 4), 2, (1, 6, 2))]


@pytest.mark.parametrize("parts", SEQS)
def test_rope_index_matches_transformers(parts):
    """0, 1 and 2 images of different grids (and a two-frame grid), text between and after, an image first;
    the shim config names no video_token_id."""
    ids, grids = seq(*parts)
    pos, delta = rope_index(ids, grids, shim())
    want, want_delta = hf_rope_index(ids, grids)
    np.testing.assert_array_equal(pos, want)
    assert delta == want_delta
    # a continuation from rope position s: the same positions shifted, the same delta
    pos2, delta2 = rope_index(ids, grids, shim(), start=11)
    np.testing.assert_array_equal(pos2, want + 11)
    assert delta2 == want_delta


def test_rope_index_errors():
    ids, grids = seq(2, (1, 4, 6), 2)
    with pytest.raises(ValueError, match="image_grid_thw has 2 grids"):
        rope_index(ids, np.concatenate([grids, grids]), shim())
    with pytest.raises(ValueError, match="more image runs"):
        rope_index(ids, None, shim())
    with pytest.raises(ValueError, match="needs 6 image tokens"):
        rope_index(ids[:-3], grids, shim())
    with pytest.raises(ValueError, match="not a multiple of spatial_merge_size"):
        rope_index(ids, [[1, 3, 6]], shim())


def test_pair_positions_interleave():
    """Pair j reads h if j % 3 == 1 and j < 3 s_h, w if j % 3 == 2 and j < 3 s_w, else t (transformers'
    recomposition_frequencies); Qwen3-Next: t everywhere; a Qwen3.5 config without the field: [11, 11, 10]."""
    cfg = ModelConfig.from_dict(PRESETS["tiny"])            # rotary 8 dims: 4 pairs, sections [2, 1, 1]
    p = np.array([[5, 6], [7, 8], [9, 10]])
    np.testing.assert_array_equal(pair_positions(p, cfg), [[5, 7, 9, 5], [6, 8, 10, 6]])
    nxt = ModelConfig.from_dict(PRESETS["tiny-qwen3-next"])
    np.testing.assert_array_equal(pair_positions(p, nxt), [[5, 5, 5, 5], [6, 6, 6, 6]])
    d = copy.deepcopy(PRESETS["tiny"])
    d["text_config"]["rope_parameters"].pop("mrope_section")
    d["text_config"]["head_dim"] = 128                      # 32 rotary dims: 16 pairs
    comp = pair_positions(np.array([[0], [1], [2]]), ModelConfig.from_dict(d))[0]
    np.testing.assert_array_equal(comp, [0, 1, 2] * 5 + [0])
    with pytest.raises(ValueError, match=r"positions must be integers \[3, n\]"):
        pair_positions(np.zeros((2, 3), np.int64), cfg)


# ---- the reference against transformers' text model --------------------------------------------------------
ATOL = 1e-3
ROPE = {"mrope_section": [3, 3, 2], "mrope_interleaved": True, "partial_rotary_factor": 0.5}   # 8 pairs


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A random HF Qwen3_5MoeForCausalLM (16 rotary dims, sections [3, 3, 2]) and the reference model on its
    saved checkpoint."""
    require("torch")
    require("transformers")
    from oracles import hf_model, save_hf
    hf = hf_model("qwen3_5_moe", {"rope_parameters": ROPE}, seed=3)
    d = save_hf(hf, tmp_path_factory.mktemp("mrope") / "hf")
    return hf, qm.Model.load(str(d), backend="reference")


def image_case(model, parts, seed=0):
    """ids, positions [3, n], image rows and random stand-in features [m, H] (N(0, 1) rows like the
    embedding's)."""
    ids, grids = seq(*parts)
    pos, delta = rope_index(ids, grids, shim())
    rows = np.flatnonzero(ids == IMG)
    feats = np.random.default_rng(seed).standard_normal((rows.size, model.config.hidden_size)).astype(np.float32)
    feats = feats.astype(qm_bf16()).astype(np.float32)
    return ids, pos, delta, rows, feats


def qm_bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def hf_forward(hf, ids, pos, rows, feats):
    import torch
    with torch.no_grad():
        emb = hf.model.embed_tokens(torch.tensor(ids)[None]).clone()
        emb[0, torch.tensor(rows)] = torch.tensor(feats)
        out = hf(inputs_embeds=emb, position_ids=torch.tensor(pos)[:, None, :], use_cache=False)
    return out.logits[0].float().numpy()


def test_reference_matches_transformers_with_images(hf_pair):
    """Two images of different grids with text between and after, fed as random feature rows at the pads and
    get_rope_index's positions: the reference's logits equal transformers' (position_ids [3, 1, n],
    inputs_embeds) at every row, prefilled at once and in two calls (the text after the last image from the
    session's delta alone)."""
    hf, model = hf_pair
    ids, pos, delta, rows, feats = image_case(model, (3, (1, 4, 6), 2, (1, 8, 4), 5))
    want = hf_forward(hf, ids, pos, rows, feats)
    s = model.new_session()
    got = model.prefill(s, ids, "all", positions=pos, embeds=feats, embed_rows=rows)
    # float32 noise on this model is ~3e-4 (text alone too); the h/w positions matter ~100x more than that
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    t_only = model.prefill(model.new_session(), ids, "all", positions=np.repeat(pos[:1], 3, 0), embeds=feats,
                           embed_rows=rows)
    assert np.abs(t_only - want).max() > 30 * ATOL
    assert s.rope_delta == delta == int(pos.max()) + 1 - ids.size and delta < 0
    cut = int(rows[-1]) + 1                      # the text after the last image: positions from the delta
    t = model.new_session()
    a = model.prefill(t, ids[:cut], "all", positions=pos[:, :cut], embeds=feats, embed_rows=rows)
    b = model.prefill(t, ids[cut:], "all")
    np.testing.assert_allclose(np.concatenate([a, b]), want, atol=ATOL, rtol=0)
    assert t.rope_delta == delta
    # text-only calls are today's path: no positions, delta 0
    u = model.new_session()
    plain = model.prefill(u, ids[:3], "all")
    assert u.rope_delta == 0
    np.testing.assert_array_equal(plain, model.prefill(model.new_session(), ids[:3], "all", positions=pos[:, :3]))


# ---- the engines against the reference ---------------------------------------------------------------------
def rel_range_err(got, want):
    return float(np.abs(np.asarray(got) - want).max() / (want.max() - want.min()))


PARTS = (3, (1, 4, 6), 2, (1, 8, 4), 5)   # 28 rows: chunks of 8 split both images


@pytest.fixture(scope="module")
def ckpt():
    from qwenmetal.testing import cached_checkpoint
    return cached_checkpoint("tiny", "mlx-q4", seed=0)


@pytest.fixture(scope="module")
def ref_run(ckpt):
    """The reference on the image case: prefill logits, then two text decode steps from the delta."""
    model = qm.Model.load(ckpt, backend="reference")
    ids, pos, delta, rows, feats = image_case(model, PARTS, seed=1)
    s = model.new_session()
    pre = model.prefill(s, ids, "all", positions=pos, embeds=feats, embed_rows=rows)
    dec = [model.decode_step(s, t) for t in (7, 11)]
    return (ids, pos, delta, rows, feats), pre, np.stack(dec)


def engine_model(ckpt, backend):
    if backend == "cpu":
        return qm.Model.load(ckpt, backend="cpu", kv_dtype="float32", threads=2, prefill_chunk=8,
                             activations="float")
    return qm.Model.load(ckpt, backend=backend, prefill_chunk=8)


@pytest.mark.parametrize("backend", ["cpu", "metal-sim"])
def test_engine_matches_reference_with_images(ckpt, ref_run, backend):
    """Image features at the pads, M-RoPE positions (prefilled in chunks that split the images), then text
    decode steps at index + delta: within 1e-3 of the logit range of the reference; the delta is the same."""
    (ids, pos, delta, rows, feats), want_pre, want_dec = ref_run
    model = engine_model(ckpt, backend)
    s = model.new_session()
    pre = model.prefill(s, ids, "all", positions=pos, embeds=feats, embed_rows=rows)
    assert s.rope_delta == delta
    dec = np.stack([model.decode_step(s, t) for t in (7, 11)])
    assert rel_range_err(pre, want_pre) < 1e-3
    assert rel_range_err(dec, want_dec) < 1e-3
    # explicit positions equal to the indices are the text path bit for bit
    a = model.prefill(model.new_session(), ids[:5], "all")
    b = model.prefill(model.new_session(), ids[:5], "all", positions=np.tile(np.arange(5), (3, 1)))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["cpu", "metal-sim"])
def test_batch_and_verify_keep_the_delta(ckpt, ref_run, backend):
    """decode_batch and verify rows of a session with a delta are bit for bit its one-token steps (the Metal
    graph's verification rows, its decode step and its pipelined decode loop)."""
    (ids, pos, delta, rows, feats), _, _ = ref_run
    from qwenmetal.session import decode_batch, rewind, verify
    model = engine_model(ckpt, backend)
    s = model.new_session()
    model.prefill(s, ids, "none", positions=pos, embeds=feats, embed_rows=rows)
    plain, other = s.fork(), model.new_session()
    model.prefill(other, [4, 5, 6])
    step = model.decode_step(plain, 7)
    np.testing.assert_array_equal(decode_batch(model, [s.fork(), other], [7, 8])[0], step)
    v = s.fork()
    rows_v = verify(model, v, [7, 11, 13])
    np.testing.assert_array_equal(rows_v[0], step)
    np.testing.assert_array_equal(rows_v[1], model.decode_step(plain, 11))
    rewind(model, v, 1)
    assert v.rope_delta == delta and v.position == s.position + 1
    if model.gpu_decode:                  # greedy tokens of the loop = greedy decode steps
        loop, steps = s.fork(), s.fork()
        got = model.decode_loop(loop, 7, 3)
        want, t = [], 7
        for _ in range(3):
            t = int(np.argmax(model.decode_step(steps, t)))
            want.append(t)
        assert list(got) == want and loop.rope_delta == delta


def test_bad_row_inputs_leave_the_session_untouched(ckpt):
    model = qm.Model.load(ckpt, backend="reference")
    s = model.new_session()
    model.prefill(s, [1, 2, 3])
    before = (s.tokens, s.rope_delta, s.images)
    H = model.config.hidden_size
    for kw, match in ((dict(positions=np.zeros((3, 2), np.int64)), r"positions must be \[3, 4\]"),
                      (dict(embeds=np.zeros((2, H), np.float32)), "name them with embed_rows"),
                      (dict(embeds=np.zeros((2, H), np.float32), embed_rows=[2, 1]), "increasing indices"),
                      (dict(embeds=np.zeros((1, H + 1), np.float32), embed_rows=[0]), r"embeds must be float \[m, 128\]"),
                      (dict(embeds=np.full((1, H), np.nan, np.float32), embed_rows=[0]), "finite"),
                      (dict(embed_rows=[0]), "embed_rows without embeds"),
                      (dict(images=[(2, 9, "x")]), r"inside 0\.\.4")):
        with pytest.raises(ValueError, match=match):
            model.prefill(s, [4, 5, 6, 7], **kw)
    assert (s.tokens, s.rope_delta, s.images) == before


# ---- sessions and the prefix cache ---------------------------------------------------------------------------
def image_session(model, case, digest="a" * 64):
    ids, pos, delta, rows, feats = case
    s = model.new_session()
    spans = [(int(rows[0]), int(rows[0]) + 6, digest), (int(rows[6]), int(rows[-1]) + 1, digest[::-1])]
    model.prefill(s, ids, "none", positions=pos, embeds=feats, embed_rows=rows, images=spans)
    return s


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_session_fork_snapshot_save_load_keep_the_delta(ckpt, ref_run, tmp_path, backend):
    """fork, snapshot/restore and save/load (a version-2 file) carry the delta and the image spans: the next
    text token's logits are bit for bit the original session's. A text-only session is still written as
    version 1 and loads with delta 0."""
    case, _, _ = ref_run
    model = qm.Model.load(ckpt, backend="reference") if backend == "reference" else engine_model(ckpt, "cpu")
    s = image_session(model, case)
    assert s.rope_delta == case[2] != 0 and len(s.images) == 2 and s.images[0].start == 3
    f, snap = s.fork(), s.snapshot()
    p = tmp_path / "s.safetensors"
    s.save(p)
    header = json.loads(open(p, "rb").read(8 + int.from_bytes(open(p, "rb").read(8), "little"))[8:])
    h = json.loads(header["__metadata__"]["qwenmetal.session"])
    assert h["version"] == 2 and h["rope_delta"] == case[2] and h["images"][0] == [3, 9, "a" * 64]
    t = qm.Session.load(p, model)
    r = model.new_session()
    r.restore(snap)
    want = model.decode_step(s, 9)
    for other in (f, t, r):
        assert other.rope_delta == case[2] and other.images == s.images[:2]
        np.testing.assert_array_equal(model.decode_step(other, 9), want)
    r.reset()
    assert r.rope_delta == 0 and r.images == ()
    u = model.new_session()
    model.prefill(u, [1, 2, 3])
    u.save(tmp_path / "u.safetensors")
    from qwenmetal.session_io import read_header
    h = read_header(tmp_path / "u.safetensors")
    assert h["version"] == 1 and "rope_delta" not in h
    assert qm.Session.load(tmp_path / "u.safetensors", model).rope_delta == 0


def test_prefix_cache_keys_on_image_content(ckpt, ref_run, tmp_path):
    """Two different images of the same size have identical pad tokens: the cache keys them on their digests, so
    a prompt with image B never resumes from a snapshot taken with image A (in memory or on disk), while the
    same image does; a prefix ending before the first image is shared by both."""
    from qwenmetal.prefix_cache import PrefixCache
    case, _, _ = ref_run
    ids = case[0]
    model = qm.Model.load(ckpt, backend="reference")
    a = image_session(model, case, digest=image_digest(np.zeros((4, 6, 3), np.uint8)))
    b_digest = image_digest(np.ones((4, 6, 3), np.uint8))
    assert b_digest != a.images[0].digest
    b_spans = [(s.start, s.end, d) for s, d in zip(a.images, (b_digest, b_digest[::-1]))]
    assert cache_key(ids, a.images) != cache_key(ids, b_spans)
    assert cache_key(ids[:3], a.images) == cache_key(ids[:3], b_spans) == tuple(int(x) for x in ids[:3])
    pc = PrefixCache(max_bytes=1 << 30)
    assert pc.put(a.tokens, a.snapshot(), kind="a")
    head = model.new_session()
    model.prefill(head, ids[:3])
    assert pc.put(head.tokens, head.snapshot(), kind="head")
    longer = list(ids) + [5]
    assert pc.lookup(longer, images=a.images).kind == "a"
    assert pc.lookup(longer, images=b_spans).kind == "head"
    assert pc.lookup(longer).kind == "head"                   # text pads: not image A either
    # the disk tier: the file carries the spans, a fresh cache keys it the same way
    pc.attach_disk(model, tmp_path / "disk")
    assert pc.persist(a.tokens, images=a.images)
    pc.disk.flush()
    fresh = PrefixCache(max_bytes=1 << 30)
    fresh.attach_disk(model, tmp_path / "disk")
    assert fresh.lookup(longer, images=b_spans) is None
    e = fresh.lookup(longer, images=a.images)
    assert e is not None and e.snapshot.images == a.images and e.snapshot.state.rope_delta == a.rope_delta
