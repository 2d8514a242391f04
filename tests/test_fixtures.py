"""qwenmetal.testing fixtures against the real tools.

* hf-bf16  == transformers' save_pretrained of the same model: same keys/shapes/dtypes/metadata/config, and a
  from_pretrained -> save_pretrained round trip of our file reproduces it byte for byte.
* mlx-*    == mlx_lm.convert of our hf-bf16 checkpoint: same files, byte-identical tensors, config.json,
  index, generation config, tokenizer.json and chat template (tokenizer_config.json: same roles).
* tokenizer / chat template: transformers' tokenizer agrees with the tokenizers library, and the template
  renders the Qwen3.5 conversation format.
"""
import contextlib
import hashlib
import io
import json
import os
import shutil
import unicodedata
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from oracles import require  # fails in CI, skips elsewhere
from qwenmetal.config import ModelConfig
from qwenmetal.quant import dequantize, quantize
from qwenmetal.testing import (BPE_VOCAB_SIZE, FORMATS, PRESETS, SPECIAL_TOKENS, build_tokenizer,
                               cached_checkpoint, hf_tensors, make_checkpoint, mlx_tensors, wrap_text_config)

BF16 = np.dtype(ml_dtypes.bfloat16)


def _next_with_dense_layer():
    d = json.loads(json.dumps(PRESETS["tiny-qwen3-next"]))
    d["mlp_only_layers"] = [1]          # layer 1: dense SwiGLU MLP (intermediate_size 128)
    return d


CONFIGS = {name: PRESETS[name] for name in PRESETS}
CONFIGS["next-dense-layer"] = _next_with_dense_layer()


def raw_tensors(path):
    """safetensors file -> (metadata, {key: (dtype, shape, raw bytes)}), straight from the file."""
    b = Path(path).read_bytes()
    n = int.from_bytes(b[:8], "little")
    header = json.loads(b[8:8 + n])
    base = 8 + n
    meta = header.pop("__metadata__", None)
    return meta, {k: (v["dtype"], v["shape"], b[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
                  for k, v in header.items()}


def file_digests(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(d).iterdir())}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_checkpoint(root / name, cfg, "hf-bf16", seed=0) for name, cfg in CONFIGS.items()}


# ---- presets, determinism, atomicity ---------------------------------------------------------------
def test_presets_are_quantizable_everywhere_and_fit_the_tokenizer():
    assert set(PRESETS) >= {"tiny", "tiny-text", "tiny-qwen3-next"}
    assert PRESETS["tiny"]["model_type"] == "qwen3_5_moe" and "text_config" in PRESETS["tiny"]
    assert PRESETS["tiny-text"]["model_type"] == "qwen3_5_moe_text"
    assert PRESETS["tiny-qwen3-next"]["model_type"] == "qwen3_next"
    n_tok = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)
    for name, d in PRESETS.items():
        c = ModelConfig.from_dict(d)
        assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",), name
        assert c.rotary_dim == 8 and c.rope_theta == 1e7 and c.num_experts == 8 and c.num_experts_per_tok == 2
        assert c.vocab_size >= n_tok
        for dim in (c.hidden_size, c.num_attention_heads * c.head_dim, c.value_dim, c.moe_intermediate_size,
                    c.shared_expert_intermediate_size):
            assert dim % 64 == 0, (name, dim)
        assert set(c.eos_token_ids) <= {SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]}


def test_make_checkpoint_is_deterministic_and_atomic(tmp_path):
    for fmt in FORMATS:
        a = make_checkpoint(tmp_path / f"a-{fmt}", "tiny", fmt, seed=3)
        b = make_checkpoint(tmp_path / f"b-{fmt}", "tiny", fmt, seed=3)
        assert file_digests(a) == file_digests(b), fmt
    c = make_checkpoint(tmp_path / "c", "tiny", "mlx-q4", seed=4)
    assert (c / "model.safetensors").read_bytes() != (tmp_path / "a-mlx-q4" / "model.safetensors").read_bytes()
    # an existing empty directory is fine, a non-empty one is refused, nothing half-written is left over
    (tmp_path / "empty").mkdir()
    assert make_checkpoint(tmp_path / "empty", "tiny-qwen3-next", "hf-bf16").is_dir()
    with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
        make_checkpoint(tmp_path / "c", "tiny", "mlx-q4")
    with pytest.raises(ValueError, match="format"):
        make_checkpoint(tmp_path / "bad", "tiny", "gguf")
    with pytest.raises(ValueError, match="preset"):
        make_checkpoint(tmp_path / "bad", "huge", "mlx-q4")
    small_vocab = json.loads(json.dumps(PRESETS["tiny-qwen3-next"]))
    small_vocab["vocab_size"] = 256
    with pytest.raises(ValueError, match="vocab_size"):
        make_checkpoint(tmp_path / "bad", small_vocab, "mlx-q4")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cached_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("QWENMETAL_CACHE", str(tmp_path / "cache"))
    p = cached_checkpoint("tiny", "mlx-q4", seed=0)
    assert p.parent == tmp_path / "cache" / "fixtures" and (p / "config.json").is_file()
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert cached_checkpoint("tiny", "mlx-q4", seed=0) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    assert cached_checkpoint("tiny", "mlx-q4", seed=1) != p
    assert file_digests(p) == file_digests(make_checkpoint(tmp_path / "fresh", "tiny", "mlx-q4", seed=0))


class _DiskFull(OSError):
    pass


def _fail_on_write(monkeypatch, n):
    """Make the n-th tensor written by the streaming safetensors writer fail like a full disk."""
    from qwenmetal import convert
    real, count = convert.SafetensorsWriter.write, [0]

    def write(self, name, a):
        count[0] += 1
        if count[0] == n:
            raise _DiskFull(28, "No space left on device")
        real(self, name, a)
    monkeypatch.setattr(convert.SafetensorsWriter, "write", write)


@pytest.mark.parametrize("fmt", ["hf-bf16", "mlx-q4"])
@pytest.mark.parametrize("exc", [_DiskFull, KeyboardInterrupt])
def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, fmt, exc):
    """An error in the middle of the weights (a full disk, Ctrl-C) leaves neither the checkpoint nor a
    partial sibling; a complete checkpoint already there is refused and left byte for byte as it was."""
    done = make_checkpoint(tmp_path / "done", "tiny", fmt, seed=1)
    before = file_digests(done)
    if exc is _DiskFull:
        _fail_on_write(monkeypatch, 5)
    else:
        from qwenmetal import convert
        real = convert.SafetensorsWriter.write

        def interrupted(self, name, a):
            if name.endswith("down_proj.weight") or name.endswith("down_proj"):
                raise KeyboardInterrupt
            real(self, name, a)
        monkeypatch.setattr(convert.SafetensorsWriter, "write", interrupted)
    with pytest.raises(exc, match="^$" if exc is KeyboardInterrupt else "cannot write .*new.*No space left"):
        make_checkpoint(tmp_path / "new", "tiny", fmt, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]
    monkeypatch.undo()
    with pytest.raises(FileExistsError, match="done exists and is not an empty directory"):
        make_checkpoint(done, "tiny", fmt, seed=2)
    assert file_digests(done) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]


def test_cached_checkpoint_failure_leaves_no_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("QWENMETAL_CACHE", str(tmp_path / "cache"))
    _fail_on_write(monkeypatch, 2)
    with pytest.raises(OSError, match="No space left"):
        cached_checkpoint("tiny-text", "mlx-q8", seed=9)
    assert list((tmp_path / "cache" / "fixtures").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("QWENMETAL_CACHE", str(tmp_path / "cache"))
    p = cached_checkpoint("tiny-text", "mlx-q8", seed=9)
    assert [q.name for q in (tmp_path / "cache" / "fixtures").iterdir()] == [p.name]


def test_sharded_streaming_write_is_the_same_model(tmp_path):
    """With a small shard limit the writer streams into several files (+ an index) holding exactly the
    tensors of the single-file checkpoint, and the loader reads them as the same weights."""
    from qwenmetal.weights import load_weights

    one = make_checkpoint(tmp_path / "one", "tiny", "mlx-q4", seed=2)
    many = make_checkpoint(tmp_path / "many", "tiny", "mlx-q4", seed=2, max_shard_bytes=100_000)
    shards = sorted(many.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (many / "model.safetensors").exists()
    _, a = raw_tensors(one / "model.safetensors")
    b = {}
    for f in shards:
        b.update(raw_tensors(f)[1])
    assert a == b
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    c = ModelConfig.from_file(one)
    wa, wb = load_weights(one, c).tensors, load_weights(many, c).tensors
    assert wa.keys() == wb.keys()
    hf = make_checkpoint(tmp_path / "hf", "tiny", "hf-bf16", seed=2, max_shard_bytes=100_000)
    assert len(list(hf.glob("model-*-of-*.safetensors"))) > 3 and (hf / "model.safetensors.index.json").is_file()


def test_random_params_share_the_writers_generator():
    """testing.random_params and the fixtures draw from the one generator: with the fixture scales the
    canonical float32 draws round to exactly the checkpoint's bf16 tensors."""
    from qwenmetal import checkpoint_writer as cw

    c = ModelConfig.from_dict(PRESETS["tiny-text"])
    p = cw.canonical_params(c, seed=4)
    hf = hf_tensors("tiny-text", seed=4)
    np.testing.assert_array_equal(p["layers.0.linear_attn.in_proj_qkv"].astype(BF16),
                                  hf["model.layers.0.linear_attn.in_proj_qkv.weight"])
    np.testing.assert_array_equal(p["layers.1.mlp.switch_mlp.up_proj"].astype(BF16),
                                  hf["model.layers.1.mlp.experts.gate_up_proj"][:, 64:])
    np.testing.assert_array_equal((p["layers.3.self_attn.q_norm"] - 1).astype(BF16),
                                  hf["model.layers.3.self_attn.q_norm.weight"])
    np.testing.assert_array_equal(p["layers.0.linear_attn.A_log"], hf["model.layers.0.linear_attn.A_log"])
    with pytest.raises(ValueError, match="unknown init 'huge'"):
        cw.text_specs(c, "huge")


def test_same_logical_model_in_every_format():
    """mlx-bf16 = sanitized hf-bf16; mlx-q4 = quantize(mlx-bf16) (router/shared gate at 8 bits)."""
    hf = hf_tensors("tiny", seed=5)
    mb = mlx_tensors("tiny", "mlx-bf16", seed=5)
    q4 = mlx_tensors("tiny", "mlx-q4", seed=5)
    L = "language_model.model.layers."
    np.testing.assert_array_equal(mb[L + "0.linear_attn.conv1d.weight"][:, :, 0],
                                  hf["model.language_model.layers.0.linear_attn.conv1d.weight"][:, 0, :])
    gu = hf["model.language_model.layers.2.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(mb[L + "2.mlp.switch_mlp.up_proj.weight"], gu[:, 64:])
    w_hf = hf["model.language_model.layers.3.self_attn.q_norm.weight"]
    np.testing.assert_array_equal(mb[L + "3.self_attn.q_norm.weight"],
                                  (w_hf.astype(np.float32) + 1).astype(BF16))
    assert hf["model.language_model.layers.0.linear_attn.A_log"].dtype == np.float32
    assert q4[L + "0.linear_attn.A_log"].dtype == np.float32
    np.testing.assert_array_equal(mb[L + "0.linear_attn.norm.weight"],
                                  hf["model.language_model.layers.0.linear_attn.norm.weight"])   # not shifted
    for key, bits in [(L + "1.mlp.gate", 8), (L + "1.mlp.shared_expert_gate", 8), (L + "1.mlp.switch_mlp.down_proj", 4),
                      ("language_model.model.embed_tokens", 4), ("language_model.lm_head", 4)]:
        ref = quantize(mb[key + ".weight"], bits, 64)
        for got, want in zip((q4[key + ".weight"], q4[key + ".scales"], q4[key + ".biases"]), ref):
            assert got.tobytes() == want.tobytes(), key
        d = dequantize(*ref, bits, 64)
        assert np.abs(d - mb[key + ".weight"].astype(np.float32)).max() < 0.2 * np.abs(d).max()
    # tiny-text is the same text model under the CausalLM prefix
    ht = hf_tensors("tiny-text", seed=5)
    assert {k.replace("model.language_model.", "model.") for k in hf if "visual" not in k} == set(ht)
    assert mlx_tensors("tiny-text", "mlx-q4", seed=5).keys() == q4.keys()


def test_qwen3_next_fused_projections_use_hf_grouping():
    """Un-fusing in_proj_qkvz / in_proj_ba with transformers' own fix_query_key_value_ordering gives back the
    split Qwen3.5 projections of the same seed (the logical weights are shared across presets)."""
    torch = require("torch")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    nxt, q35 = hf_tensors("tiny-qwen3-next", seed=1), hf_tensors("tiny-text", seed=1)
    c = ModelConfig.from_dict(PRESETS["tiny-qwen3-next"])

    class Dims:
        num_k_heads, num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        head_k_dim, head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim

    p = "model.layers.0.linear_attn."
    t = lambda a: torch.from_numpy(a.astype(np.float32).T.copy())[None]      # [1, H, out]: rows as "tokens"
    q, k, v, z, b, a = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(
        Dims(), t(nxt[p + "in_proj_qkvz.weight"]), t(nxt[p + "in_proj_ba.weight"]))
    back = lambda x: x.reshape(x.shape[1], -1).T.numpy()
    qkv = q35[p + "in_proj_qkv.weight"].astype(np.float32)
    kd = c.key_dim
    np.testing.assert_array_equal(back(q), qkv[:kd])
    np.testing.assert_array_equal(back(k), qkv[kd:2 * kd])
    np.testing.assert_array_equal(back(v), qkv[2 * kd:])
    np.testing.assert_array_equal(back(z), q35[p + "in_proj_z.weight"].astype(np.float32))
    np.testing.assert_array_equal(back(b), q35[p + "in_proj_b.weight"].astype(np.float32))
    np.testing.assert_array_equal(back(a), q35[p + "in_proj_a.weight"].astype(np.float32))


# ---- hf-bf16 vs transformers -------------------------------------------------------------------------
_HF_CLASSES = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "qwen3_next": "Qwen3NextForCausalLM"}
# keys our configs carry only for mlx-lm's sake (transformers 5 keeps them in rope_parameters)
_MLX_ONLY_KEYS = {"rope_theta", "partial_rotary_factor"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_bf16_is_what_transformers_saves(name, hf_dirs, tmp_path):
    torch = require("torch")
    transformers = require("transformers")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    cfg = CONFIGS[name]
    ours = hf_dirs[name]
    cls = getattr(transformers, _HF_CLASSES[cfg["model_type"]])
    save_kw = {} if cfg["model_type"] == "qwen3_next" else {"save_original_format": False}   # fused experts

    # 1. a fresh random model of the same config, saved by transformers (bf16; A_log kept float32 like
    #    Qwen's releases): same keys, shapes, dtypes, metadata and config.json
    torch.manual_seed(0)
    model = cls(cls.config_class.from_dict(json.loads(json.dumps(cfg)))).to(torch.bfloat16)
    for n, prm in model.named_parameters():
        if n.endswith("A_log"):
            prm.data = prm.data.float()
    model.save_pretrained(tmp_path / "tf", **save_kw)
    m_ours, t_ours = raw_tensors(ours / "model.safetensors")
    m_tf, t_tf = raw_tensors(tmp_path / "tf" / "model.safetensors")
    assert m_ours == m_tf == {"format": "pt"}
    assert set(t_ours) == set(t_tf)
    assert {k: v[:2] for k, v in t_ours.items()} == {k: v[:2] for k, v in t_tf.items()}
    c_ours = json.loads((ours / "config.json").read_text())
    c_tf = json.loads((tmp_path / "tf" / "config.json").read_text())
    c_tf.pop("transformers_version")
    assert {k: v for k, v in c_ours.items() if k not in _MLX_ONLY_KEYS} == c_tf

    # 2. transformers loads our checkpoint exactly (nothing missing, unexpected or mismatched) and writes
    #    it back byte for byte
    m2, info = cls.from_pretrained(ours, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    for n, prm in m2.named_parameters():
        if not n.endswith("A_log"):
            prm.data = prm.data.to(torch.bfloat16)
    m2.save_pretrained(tmp_path / "rt", **save_kw)
    assert (tmp_path / "rt" / "model.safetensors").read_bytes() == (ours / "model.safetensors").read_bytes()


# ---- mlx formats vs mlx_lm.convert -------------------------------------------------------------------
_MLX_CASES = [("tiny", "mlx-q4"), ("tiny", "mlx-bf16"), ("tiny", "mlx-q8"), ("tiny-text", "mlx-q4"),
              ("tiny-qwen3-next", "mlx-q4"), ("tiny-qwen3-next", "mlx-bf16"), ("next-dense-layer", "mlx-q4"),
              ("tiny", "mlx-q3"), ("tiny", "mlx-q6"), ("tiny", "mlx-q4-e2"), ("tiny-qwen3-next", "mlx-q4-e3")]
# format -> (bits, routed-expert bits or None: as the rest)
_MLX_BITS = {"mlx-q2": (2, None), "mlx-q3": (3, None), "mlx-q4": (4, None), "mlx-q5": (5, None),
             "mlx-q6": (6, None), "mlx-q8": (8, None), "mlx-q4-e2": (4, 2), "mlx-q4-e3": (4, 3)}


def expert_bits_predicate(expert_bits):
    """The ``quant_predicate`` a user hands ``mlx_lm.convert`` for routed experts at `expert_bits`: the
    model's own rule (router and shared-expert gate at 8 bits), plus ``switch_mlp.*`` at that width."""
    def predicate(path, module):
        if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        if ".switch_mlp." in path:
            return {"group_size": 64, "bits": expert_bits, "mode": "affine"}
        return True
    return predicate


@pytest.mark.parametrize("name, fmt", _MLX_CASES)
def test_mlx_format_is_what_mlx_lm_convert_writes(name, fmt, hf_dirs, tmp_path):
    require("mlx.core")
    mlx_lm = require("mlx_lm")
    src = hf_dirs[name]
    if CONFIGS[name]["model_type"] == "qwen3_5_moe_text":
        # mlx-lm has no qwen3_5_moe_text model: convert the same files under the nested (released) config
        src = tmp_path / "wrapped"
        shutil.copytree(hf_dirs[name], src)
        (src / "config.json").write_text(
            json.dumps(wrap_text_config(json.loads((src / "config.json").read_text())), indent=2, sort_keys=True))
    real = tmp_path / "real"
    q = fmt != "mlx-bf16"
    bits, expert_bits = _MLX_BITS.get(fmt, (None, None))
    kw = {"quant_predicate": expert_bits_predicate(expert_bits)} if expert_bits else {}
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(str(src), str(real), quantize=q, q_bits=bits, q_group_size=64 if q else None, **kw)
    ours = make_checkpoint(tmp_path / "ours", CONFIGS[name], fmt, seed=0)

    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in real.iterdir())
    m_ours, t_ours = raw_tensors(ours / "model.safetensors")
    m_real, t_real = raw_tensors(real / "model.safetensors")
    assert m_ours == m_real == {"format": "mlx"}
    assert set(t_ours) == set(t_real)
    for k in t_real:
        assert t_ours[k][:2] == t_real[k][:2], (k, t_ours[k][:2], t_real[k][:2])
        assert t_ours[k][2] == t_real[k][2], f"{k}: bytes differ"
    for fn in ("config.json", "model.safetensors.index.json", "generation_config.json", "README.md",
               "tokenizer.json", "chat_template.jinja"):
        assert (ours / fn).read_bytes() == (real / fn).read_bytes(), fn
    # transformers re-saves tokenizer_config.json with its own bookkeeping; the roles must agree
    tc_ours = json.loads((ours / "tokenizer_config.json").read_text())
    tc_real = json.loads((real / "tokenizer_config.json").read_text())
    for key in ("eos_token", "pad_token", "bos_token", "tokenizer_class"):
        assert tc_ours[key] == tc_real[key], key

    # the checkpoint is what the engine expects, and mlx-lm loads and runs it
    cfg = json.loads((ours / "config.json").read_text())
    assert ModelConfig.from_dict(cfg).vocab_size == 512
    if q:
        model, tok = mlx_lm.load(str(ours))
        lm = model.language_model.model if hasattr(model, "language_model") else model.model
        assert lm.layers[0].mlp.gate.bits == 8 and lm.layers[0].mlp.shared_expert_gate.bits == 8
        assert lm.embed_tokens.bits == bits
        assert lm.layers[0].mlp.switch_mlp.down_proj.bits == (expert_bits or bits)
        import mlx.core as mx
        logits = model(mx.array([tok.encode("hello world")]))
        assert logits.shape[-1] == 512 and bool(mx.all(mx.isfinite(logits.astype(mx.float32))))


def test_mlx_q4_layout_details():
    """Spot checks of the MLX layout that the engine relies on (docs/model.md §2.2)."""
    t = mlx_tensors("tiny", "mlx-q4", seed=0)
    L = "language_model.model.layers."
    assert t[L + "0.linear_attn.in_proj_qkv.weight"].shape == (256, 16) and t[L + "0.linear_attn.in_proj_qkv.weight"].dtype == np.uint32
    assert t[L + "0.linear_attn.in_proj_qkv.scales"].shape == (256, 2) and t[L + "0.linear_attn.in_proj_qkv.scales"].dtype == BF16
    assert t[L + "0.mlp.gate.weight"].shape == (8, 32)                     # 8-bit router
    assert t[L + "0.mlp.shared_expert_gate.weight"].shape == (1, 32)
    assert t[L + "0.mlp.switch_mlp.down_proj.weight"].shape == (8, 128, 8)
    assert t[L + "0.linear_attn.conv1d.weight"].shape == (256, 4, 1)
    assert t[L + "3.self_attn.q_proj.weight"].shape == (256, 16)
    assert not any(k.startswith(("model.visual", "vision_tower", "mtp")) for k in t)
    cfg = json.loads(make_checkpoint_config("tiny"))
    assert cfg["model_type"] == "qwen3_5_moe" and "vision_config" not in cfg
    assert cfg["quantization"] == cfg["quantization_config"]
    assert cfg["quantization"]["language_model.model.layers.2.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
    assert cfg["eos_token_id"] == [SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]]


def make_checkpoint_config(preset, fmt="mlx-q4"):
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        return (make_checkpoint(Path(d) / "c", preset, fmt) / "config.json").read_text()


# ---- tokenizer and chat template ---------------------------------------------------------------------
_SAMPLES = [
    "Hello world", "  leading spaces and\ttabs\n\nnewlines\r\n", "numbers 1234567 and 3.14",
    "Ünïcödé café naïve Straße", "e\u0301 (decomposed) vs \u00e9", "中文你好，世界", "emoji 🙂👨‍👩‍👧 ok",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>", "it's we'll I'M",
]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_tokenizer(preset, hf_dirs):
    tok = build_tokenizer(preset)
    assert tok.get_vocab_size() == BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)
    for content, i in SPECIAL_TOKENS.items():
        assert tok.token_to_id(content) == i
        assert tok.encode(f"a{content}b").ids[1] == i           # matched before BPE
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"}
    for s in _SAMPLES:
        ids = tok.encode(s).ids
        assert max(ids) < 512
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", s)
    assert tok.encode("12").ids == [tok.token_to_id("1"), tok.token_to_id("2")]       # one digit per token

    transformers = require("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dirs[preset]))
    assert type(hf_tok).__name__ == ("Qwen2Tokenizer" if preset == "tiny-qwen3-next" else "Qwen3_5Tokenizer")
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>" and hf_tok.bos_token is None
    for s in _SAMPLES:
        assert hf_tok(s, add_special_tokens=True)["input_ids"] == tok.encode(s).ids, s
    gen = json.loads((hf_dirs[preset] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]]
    assert (gen["temperature"], gen["top_k"], gen["top_p"], gen["do_sample"]) == (1.0, 20, 0.95, True)
    tc = json.loads((hf_dirs[preset] / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == (hf_dirs[preset] / "chat_template.jinja").read_text()
    assert tc["added_tokens_decoder"][str(SPECIAL_TOKENS["<think>"])]["special"] is False


def _render(hf_tok, messages, **kw):
    return hf_tok.apply_chat_template(messages, tokenize=False, **kw)


def test_chat_template(hf_dirs):
    transformers = require("transformers")
    t = transformers.AutoTokenizer.from_pretrained(str(hf_dirs["tiny"]))
    user = [{"role": "user", "content": "  What is 2+2?  "}]
    assert _render(t, user, add_generation_prompt=True) == \
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert _render(t, user, add_generation_prompt=True, enable_thinking=False) == \
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert _render(t, user) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"

    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\ngreet back\n</think>\n\nHello!"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "add", "content": "4"}]
    assert _render(t, conv) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"                       # before the last query: no think
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n")
    assert "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello!<|im_end|>" in \
        _render(t, conv, preserve_thinking=True)

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conv = [{"role": "system", "content": "Sys."},
            {"role": "user", "content": "Weather in Berlin and Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Berlin"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
            {"role": "tool", "content": "21C"},
            {"role": "tool", "content": "19C"}]
    out = _render(t, conv, tools=tools, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                          + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>")
    assert "</IMPORTANT>\n\nSys.<|im_end|>\n<|im_start|>user\nWeather in Berlin and Paris?<|im_end|>\n" in out
    assert out.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n<tool_response>\n19C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    with pytest.raises(Exception, match="No user query"):
        _render(t, [{"role": "system", "content": "x"}])
