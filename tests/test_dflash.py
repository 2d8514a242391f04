"""DFlash drafts (python/qwenmetal/dflash.py): the loader and its errors, the numpy reference of the draft and of
its drafting loop, and the reference's draft logits against both published runtimes -- ``dflash`` (torch CPU,
float32) and ``dflash-mlx`` (MLX CPU, float32) -- on random drafts in the published layout, at tiny width and
at Qwen3.6-35B-A3B-DFlash's width (tests/dflash_oracles.py). The oracle tests fail, not skip, with CI=true."""
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import qwenmetal as qm
from dflash_oracles import (
    REAL,
    TINY,
    TINY2,
    draft_config,
    mlx_rounds,
    random_rounds,
    random_target_head,
    random_tensors,
    tensor_shapes,
    torch_rounds,
    write_draft,
    write_mlx_quantized,
)
from oracles import hf_model, require, save_hf
from qwenmetal.backends.reference import ReferenceModel
from qwenmetal.config import ModelConfig
from qwenmetal.dflash import (
    DFlashConfig,
    DFlashReference,
    DFlashRound,
    build_target_layer_ids,
    check_target,
    dflash_generate_greedy,
    load_dflash_draft,
)
from qwenmetal.errors import CheckpointError
from qwenmetal.testing import PRESETS, random_params
from qwenmetal.weights import QuantizedTensor

ATOL = 1e-4


def _ref(path, cfg):
    draft = load_dflash_draft(path)
    embed, head = random_target_head(cfg)
    return DFlashReference(draft.config, draft.float32(), embed, head), embed, head


def _our_rounds(ref, rounds):
    cache = ref.new_cache()
    return [ref.logits(ref.forward(cache, f, b)[1:]) for f, b in rounds]


def _close(name, got, want, atol=ATOL):
    for r, (g, w) in enumerate(zip(got, want)):
        err = float(np.abs(g - w).max())
        assert err <= atol, f"{name}, round {r}: max |diff| {err:.3g} > {atol} (logit range {np.abs(w).max():.3g})"


def _oracle(which):
    """The oracle's modules, or skip (fail with CI=true)."""
    if which == "torch":
        require("torch")
        require("transformers")
        return require("dflash.model")
    require("mlx.core")
    require("mlx_lm")
    return require("dflash_mlx.model")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    return write_draft(d / "tiny", TINY, random_tensors(TINY, seed=0))


# ---- config and loader ---------------------------------------------------------------------------
def test_the_published_config_parses():
    c = DFlashConfig.from_dict(REAL)
    assert (c.variant, c.hidden_size, c.num_hidden_layers, c.block_size, c.mask_token_id) == \
        ("dflash", 2048, 8, 16, 248070)
    assert c.target_layer_ids == (1, 10, 19, 28, 37) == build_target_layer_ids(40, 5)
    assert c.feature_size == 5 * 2048 and c.head_dim == 128 and c.rope_theta == 1e7
    # no target_layer_ids: the published default spread over num_target_layers
    d = dict(REAL, dflash_config={"mask_token_id": 248070})
    assert DFlashConfig.from_dict(d).target_layer_ids == build_target_layer_ids(40, 8)
    assert DFlashConfig.from_dict(TINY2).variant == "dflash2"


def _broken(tmp_path, cfg=TINY, config=None, drop=(), add=None, reshape=None):
    t = random_tensors(cfg)
    for k in drop:
        del t[k]
    t.update(add or {})
    for k, shape in (reshape or {}).items():
        t[k] = np.zeros(shape, np.float32)
    return write_draft(tmp_path / "broken", config if config is not None else cfg, t)


@pytest.mark.parametrize("case, expect", [
    (dict(config=dict(TINY, architectures=["DFlash3DraftModel"])), "unknown DFlash variant"),
    (dict(config=dict(TINY, dflash_config={"mask_token_id": 255, "target_layer_ids": [1], "markov_rank": 8})),
     "unknown DFlash variant"),
    (dict(config={k: v for k, v in TINY.items() if k != "dflash_config"}), "no 'dflash_config'"),
    (dict(config=dict(TINY, dflash_config={"target_layer_ids": [1, 3]})), "mask_token_id"),
    (dict(config=dict(TINY, model_type="llama")), "model_type"),
    (dict(config=dict(TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0})), "RoPE scaling"),
    (dict(config=dict(TINY, is_causal=True)), "is_causal"),
    (dict(drop=["layers.1.mlp.up_proj.weight"]), "missing tensor 'layers.1.mlp.up_proj'"),
    (dict(reshape={"fc.weight": (128, 128)}), "fc.weight"),
    (dict(add={"layers.0.self_attn.sinks": np.zeros(4, np.float32)}), "unexpected tensor 'layers.0.self_attn.sinks'"),
    (dict(add={"lm_head.weight": np.zeros((256, 128), np.float32)}), "its own ['lm_head']"),
])
def test_loader_errors(tmp_path, case, expect):
    path = _broken(tmp_path, **case)
    with pytest.raises(CheckpointError, match=re.escape(expect)):
        load_dflash_draft(path)


def test_loader_names_a_dflash2_file_as_another_variant(tmp_path):
    """A DFlash2 file under a DFlash config is refused with the tensors it does not know."""
    t = random_tensors(TINY2)
    cfg = dict(TINY2, architectures=["DFlashDraftModel"], dflash_config=TINY["dflash_config"])
    with pytest.raises(CheckpointError, match="unexpected tensor .*another DFlash variant"):
        load_dflash_draft(write_draft(tmp_path / "d2", cfg, t))


def test_prefixed_keys_load(tmp_path):
    t = {"model." + k: v for k, v in random_tensors(TINY).items()}
    draft = load_dflash_draft(write_draft(tmp_path / "p", TINY, t))
    assert set(draft.tensors) >= {"fc", "norm", "layers.1.self_attn.k_norm"} and not draft.quantized


def _target(**over):
    d = json.loads(json.dumps(PRESETS["tiny"]))
    d["text_config"].update(over)
    return ModelConfig.from_dict(d)


@pytest.mark.parametrize("over, draft_over, expect", [
    ({"hidden_size": 256}, {}, "hidden_size 128 does not match the target's 256"),
    ({}, {"vocab_size": 256}, "vocab_size 256 does not match the target's 512"),
    ({}, {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 4]}}, "name layers [4]"),
    ({}, {"num_target_layers": 40}, "num_target_layers 40"),
])
def test_mismatched_target(tmp_path, over, draft_over, expect):
    cfg = draft_config(TINY, vocab_size=512, num_target_layers=4,
                       dflash_config={"mask_token_id": 511, "target_layer_ids": [1, 2]})
    cfg.update(draft_over)
    path = write_draft(tmp_path / "m", cfg, random_tensors(cfg))
    with pytest.raises(CheckpointError, match=re.escape(expect)):
        load_dflash_draft(path, target=_target(**over))
    with pytest.raises(CheckpointError, match=re.escape(expect)):
        check_target(DFlashConfig.from_file(path), _target(**over))


# ---- the reference -------------------------------------------------------------------------------
def test_target_features_in_the_same_pass():
    """`ReferenceModel.forward(feature_layers=..)` hands back the listed layers' outputs, concatenated, from the
    pass that computes the logits; split calls give the rows of one call."""
    c = ModelConfig.from_dict(PRESETS["tiny"])
    m = ReferenceModel(c, random_params(c, 0))
    ids = np.arange(3, 14)
    hidden, feats = [], []
    logits = m.forward(m.new_state(), ids, logits="all", hidden=hidden, feature_layers=(2, 0), features=feats)
    np.testing.assert_array_equal(feats[0], np.concatenate([hidden[3], hidden[1]], axis=-1))
    np.testing.assert_array_equal(logits, m.forward(m.new_state(), ids, logits="all"))
    st, parts = m.new_state(), []
    for a, b in ((0, 6), (6, 7), (7, 11)):
        m.forward(st, ids[a:b], feature_layers=(2, 0), features=parts)
    np.testing.assert_allclose(np.concatenate(parts), feats[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="feature_layers"):
        m.forward(m.new_state(), ids, feature_layers=(4,), features=[])


def test_cached_rounds_equal_one_call(tiny):
    """The context rows a round appends to the cache are the rows a fresh call over all the context sees."""
    ref, _, _ = _ref(tiny, TINY)
    rounds = random_rounds(TINY)
    cache = ref.new_cache()
    for r, (f, b) in enumerate(rounds):
        got = ref.forward(cache, f, b)
        allf = np.concatenate([x for x, _ in rounds[:r + 1]])
        np.testing.assert_allclose(got, ref.forward(ref.new_cache(), allf, b), rtol=1e-5, atol=1e-5)
    assert cache.position == sum(f.shape[0] for f, _ in rounds)
    # a call without commit leaves the cache as it was; an empty context round works
    before = cache.copy()
    ref.forward(cache, rounds[0][0], rounds[0][1], commit=False)
    assert cache.position == before.position and all(np.array_equal(a, b) for a, b in zip(cache.keys, before.keys))
    assert ref.forward(cache, np.zeros((0, ref.config.feature_size), np.float32), rounds[0][1]).shape == (8, 128)


def _tiny_pair(tmp_path, seed: int, block_size: int, layers: list) -> tuple:
    """The tiny reference target (random weights of `seed`) and a random draft made for it."""
    c = ModelConfig.from_dict(PRESETS["tiny"])
    target = ReferenceModel(c, random_params(c, seed))
    cfg = draft_config(TINY, vocab_size=512, num_target_layers=4, block_size=block_size,
                       dflash_config={"mask_token_id": 511, "target_layer_ids": layers})
    draft = DFlashReference.from_draft(load_dflash_draft(write_draft(tmp_path / "d", cfg, random_tensors(cfg))),
                                       target)
    return target, draft


def test_greedy_generation_is_lossless_and_drafts_from_the_accepted_features(tmp_path):
    """`dflash_generate_greedy` gives the target's own greedy tokens, and each round's drafts are the draft's
    greedy block over exactly the features of the tokens the target had accepted (recomputed from one pass
    over the final sequence)."""
    target, draft = _tiny_pair(tmp_path, 0, block_size=4, layers=[1, 2])
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 400, 10)]
    res = dflash_generate_greedy(target, draft, prompt, 14)
    st = target.new_state()
    plain = list(prompt)
    nxt = int(np.argmax(target.forward(st, np.asarray(prompt))))
    for _ in range(14):
        plain.append(nxt)
        nxt = int(np.argmax(target.forward(st, np.asarray([nxt]))))
    assert res["tokens"] == plain
    assert sum(res["acceptance_lengths"]) == 14 - 1 and len(res["drafts"]) == len(res["acceptance_lengths"])
    feats = []
    target.forward(target.new_state(), np.asarray(plain), logits="none", feature_layers=(1, 2), features=feats)
    rnd, start = DFlashRound(draft), len(prompt)
    rnd.observe(feats[0][:start])
    for drafted, produced in zip(res["drafts"], res["acceptance_lengths"]):
        size = min(4, len(prompt) + 14 - start)
        got, _ = rnd.propose(plain[start], size)
        np.testing.assert_array_equal(got, drafted)
        rnd.observe(feats[0][start:start + produced])
        start += produced


# ---- against the published runtimes --------------------------------------------------------------
def test_tiny_draft_logits_match_dflash_torch(tiny):
    _oracle("torch")
    ref, embed, head = _ref(tiny, TINY)
    rounds = random_rounds(TINY)
    _close("dflash (torch)", _our_rounds(ref, rounds), torch_rounds(tiny, embed, head, rounds))


@pytest.mark.parametrize("cache_kind", ["full", "window"])
def test_tiny_draft_logits_match_dflash_mlx(tiny, cache_kind):
    _oracle("mlx")
    ref, embed, head = _ref(tiny, TINY)
    rounds = random_rounds(TINY)
    _close(f"dflash-mlx ({cache_kind} cache)", _our_rounds(ref, rounds), mlx_rounds(tiny, embed, head, rounds, cache_kind))


def test_dflash2_logits_and_drafts_match_dflash_torch(tmp_path):
    _oracle("torch")
    path = write_draft(tmp_path / "d2", TINY2, random_tensors(TINY2, seed=4))
    ref, embed, head = _ref(path, TINY2)
    rounds = random_rounds(TINY2)
    want = torch_rounds(path, embed, head, rounds, variant="dflash2")
    cache = ref.new_cache()
    for r, ((f, b), (w_logits, w_tokens)) in enumerate(zip(rounds, want)):
        tokens, logits = ref.propose(cache, f, b[0], len(b))
        _close("DFlash2 (torch)", [logits], [w_logits])
        np.testing.assert_array_equal(tokens, w_tokens, err_msg=f"round {r}")


def test_real_width_draft_logits_match_both(tmp_path):
    """Qwen3.6-35B-A3B-DFlash's widths (hidden 2048, 32x128 heads over 4 KV heads, MLP 6144, features of 5 target
    layers, block 16, RoPE theta 1e7), one layer and a 1024-token vocabulary (see dflash_oracles.REAL)."""
    _oracle("torch")
    _oracle("mlx")
    cfg = draft_config(REAL, num_hidden_layers=1, vocab_size=1024,
                       dflash_config={"mask_token_id": 1000, "target_layer_ids": [1, 10, 19, 28, 37]})
    path = write_draft(tmp_path / "real", cfg, random_tensors(cfg, seed=7))
    ref, embed, head = _ref(path, cfg)
    rounds = random_rounds(cfg, lengths=(9, 3, 1))
    ours = _our_rounds(ref, rounds)
    _close("dflash (torch), real width", ours, torch_rounds(path, embed, head, rounds))
    _close("dflash-mlx, real width", ours, mlx_rounds(path, embed, head, rounds))


def test_target_layer_defaults_match_both():
    t, m = _oracle("torch"), _oracle("mlx")
    for layers, n in ((40, 5), (40, 8), (64, 5), (28, 1), (48, 3)):
        assert build_target_layer_ids(layers, n) == tuple(t.build_target_layer_ids(layers, n)) == \
            tuple(m.build_target_layer_ids(layers, n))


@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 32)])
def test_mlx_quantized_copy(tiny, tmp_path, bits, group_size):
    """An MLX-quantized copy loads as quantized tensors that dequantize to MLX's own values, and its logits
    equal dflash-mlx's on the same copy (and differ from the bf16 draft's)."""
    _oracle("mlx")
    import mlx.core as mx
    q = write_mlx_quantized(tiny, tmp_path / "q", bits, group_size)
    draft = load_dflash_draft(q)
    assert draft.quantized
    t = draft.tensors["layers.0.mlp.down_proj"]
    assert isinstance(t, QuantizedTensor) and (t.bits, t.group_size) == (bits, group_size)
    assert not isinstance(draft.tensors["norm"], QuantizedTensor)
    f32 = draft.float32()
    for name, t in draft.tensors.items():
        if isinstance(t, QuantizedTensor):
            want = mx.dequantize(mx.array(t.weight), mx.array(np.asarray(t.scales, np.float32)),
                                 mx.array(np.asarray(t.biases, np.float32)), group_size=group_size, bits=bits)
            np.testing.assert_array_equal(f32[name], np.array(want), err_msg=name)
    assert sorted(k + ".weight" for k, v in draft.tensors.items() if isinstance(v, QuantizedTensor)) == \
        sorted(k for k, s in tensor_shapes(TINY).items() if len(s) == 2)
    ref, embed, head = _ref(q, TINY)
    rounds = random_rounds(TINY)
    ours = _our_rounds(ref, rounds)
    _close(f"dflash-mlx, {bits}-bit g{group_size} copy", ours, mlx_rounds(q, embed, head, rounds))
    plain, _, _ = _ref(tiny, TINY)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, _our_rounds(plain, rounds))) > 1e-3


def test_greedy_generation_keeps_accepted_drafts(tmp_path):
    """With drafts that follow the target's own greedy continuation (a wrong token every third round), rounds
    accept several tokens, the output stays the target's greedy output, and each accepted round's features
    reach the draft (its cache position follows the accepted tokens)."""
    target, draft = _tiny_pair(tmp_path, 1, block_size=5, layers=[0, 3])
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 400, 7)]
    st, plain = target.new_state(), list(prompt)
    nxt = int(np.argmax(target.forward(st, np.asarray(prompt))))
    for _ in range(20):
        plain.append(nxt)
        nxt = int(np.argmax(target.forward(st, np.asarray([nxt]))))
    seen, real = [], draft.propose

    def oracle_propose(cache, features, first_token, block_len=None):
        _, logits = real(cache, features, first_token, block_len)
        seen.append(cache.position)
        at = cache.position                       # the first token's index in the sequence
        want = np.array(plain[at + 1:at + block_len] + [0] * block_len)[:block_len - 1]
        if len(seen) % 3 == 0:
            want[1] = (want[1] + 1) % 512         # wrong at the second draft: one draft accepted
        return want, logits

    draft.propose = oracle_propose
    res = dflash_generate_greedy(target, draft, prompt, 20)
    assert res["tokens"] == plain
    assert max(res["acceptance_lengths"]) == 5 and 2 in res["acceptance_lengths"]
    assert seen == [len(prompt) + sum(res["acceptance_lengths"][:r]) for r in range(len(seen))]


def test_sliding_window_layers_match_both(tmp_path):
    """A draft with a sliding-attention layer (as the Gemma drafts have): causal within a window over the
    context and the block, in both runtimes; the window changes the logits."""
    _oracle("torch")
    _oracle("mlx")
    cfg = draft_config(TINY, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                       use_sliding_window=True)
    path = write_draft(tmp_path / "swa", cfg, random_tensors(cfg))
    ref, embed, head = _ref(path, cfg)
    rounds = random_rounds(cfg)
    ours = _our_rounds(ref, rounds)
    _close("dflash (torch), sliding window", ours, torch_rounds(path, embed, head, rounds))
    _close("dflash-mlx, sliding window", ours, mlx_rounds(path, embed, head, rounds))
    full = DFlashReference(DFlashConfig.from_dict(dict(cfg, layer_types=["full_attention"] * 2)),
                           ref.params, embed, head)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, _our_rounds(full, rounds))) > 1e-2


class _Recomputed:
    """A transformers target for dflash's ``dflash_generate``, made exact: the loop rewinds the target by cropping
    its cache, which does not restore a hybrid model's linear-attention state (on Qwen3.5-MoE the tokens leave
    the target's own greedy output after the first rejected draft). Here each call recomputes the whole sequence
    up to its position ids without a cache: the cache the loop makes for it stays empty and its crops are
    skipped (`crop`). The blocks it is asked to run are recorded: the prompt's prefill, then one block per
    round."""

    def __init__(self, hf):
        self.hf, self.history, self.blocks, self.cache = hf, [], [], None
        self.config, self.device, self.lm_head = hf.config, hf.device, hf.lm_head

    def crop(self, crop_to):
        """dflash's ``_crop_to``, except for this target's cache."""
        return lambda cache, length: None if cache is self.cache else crop_to(cache, length)

    def get_input_embeddings(self):
        return self.hf.get_input_embeddings()

    def __call__(self, input_ids, position_ids, past_key_values, logits_to_keep=0, output_hidden_states=False, **_):
        self.cache = past_key_values
        p0, n = int(position_ids[0, 0]), input_ids.shape[1]
        self.history = self.history[:p0] + [int(t) for t in input_ids[0]]
        self.blocks.append([int(t) for t in input_ids[0]])
        ids = input_ids.new_tensor([self.history])
        out = self.hf(input_ids=ids, use_cache=False, output_hidden_states=output_hidden_states)
        keep = logits_to_keep or n
        return SimpleNamespace(logits=out.logits[:, -keep:],
                               hidden_states=[h[:, -n:] for h in out.hidden_states] if output_hidden_states else None)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_drafting_loop_matches_dflash_generate_on_a_hybrid_target(tmp_path, monkeypatch, kind):
    """The whole loop end to end against dflash's own ``dflash_generate`` (torch CPU, float32) on a hybrid
    target (transformers' Qwen3.5-MoE / Qwen3-Next, random weights, made exact by `_Recomputed`) and a random
    draft in the published layout: the same tokens, the same block drafted in every round (so the same
    features, positions and draft-cache crops) and the same acceptance lengths, with our
    `dflash_generate_greedy` on the reference of the same checkpoint."""
    dfm = _oracle("torch")
    torch = require("torch")
    hf = hf_model(kind)
    model = qm.Model.load(str(save_hf(hf, tmp_path / "target")), backend="reference")
    tc = model.config
    cfg = draft_config(TINY, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, block_size=4,
                       num_target_layers=tc.num_hidden_layers,
                       dflash_config={"mask_token_id": tc.vocab_size - 1,
                                      "target_layer_ids": [1, tc.num_hidden_layers - 2]})
    path = write_draft(tmp_path / "draft", cfg, random_tensors(cfg, seed=5))
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, tc.vocab_size - 1, 9)]
    new = 13

    exact = _Recomputed(hf)
    monkeypatch.setattr(dfm, "_crop_to", exact.crop(dfm._crop_to))
    draft = dfm.DFlashDraftModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    want = [int(t) for t in dfm.dflash_generate(draft, exact, torch.tensor([prompt]), new, None)[0]]
    verified = exact.blocks[1:]

    ref = model.reference_model
    ours = dflash_generate_greedy(ref, DFlashReference.from_draft(load_dflash_draft(path), ref), prompt, new)
    assert ours["tokens"] == want
    assert [[b[0]] + list(d) for b, d in zip(verified, ours["drafts"])] == verified
    assert len(ours["drafts"]) == len(verified)
    starts = [len(prompt) + sum(ours["acceptance_lengths"][:r]) for r in range(len(verified))]
    assert [want[s] for s in starts] == [b[0] for b in verified]
