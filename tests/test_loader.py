"""Config parsing and the strict checkpoint loader: every malformed input names file and tensor."""
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import qwenmetal as qm
from qwenmetal.config import ModelConfig
from qwenmetal.errors import CheckpointError
from qwenmetal.safetensors_io import TensorSource
from qwenmetal.testing import PRESETS, make_checkpoint
from qwenmetal.weights import QuantizedTensor, load_weights


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {(p, f): make_checkpoint(root / f"{p}-{f}", config=p, format=f, seed=0)
            for p in ("tiny", "tiny-qwen3-next") for f in ("mlx-q4", "mlx-bf16", "hf-bf16")}


def copy(src, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def rewrite(dirpath, edit):
    """Load the (single) safetensors file, let `edit` change the dict, write it back."""
    files = sorted(dirpath.glob("*.safetensors"))
    assert len(files) == 1
    src = TensorSource(dirpath)
    tensors = {k: np.array(src.get(k)) for k in src.keys()}
    md = src.metadata
    del src
    edit(tensors)
    (dirpath / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(files[0]), metadata=md)


# ---- config ------------------------------------------------------------------------------
def test_config_from_presets_has_no_35b_constants():
    for name, d in PRESETS.items():
        c = ModelConfig.from_dict(d)
        assert c.num_hidden_layers == len(c.layer_types)
        assert "ModelConfig(" in repr(c)


def test_config_nested_text_config_and_rope_parameters():
    base = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "eos_token_id": 7,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
            "full_attention_interval": 4}
    c = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": base, "eos_token_id": 9,
                               "quantization": {"bits": 4, "group_size": 64,
                                                "language_model.model.layers.0.mlp.gate": {"bits": 8, "group_size": 64}}})
    assert c.full_attention_layers == (3, 7) and c.rotary_dim == 8 and c.rope_theta == 1e6
    assert c.eos_token_ids == (7, 9)
    assert c.quantization.spec_for("language_model.model.layers.0.mlp.gate").bits == 8
    assert c.quantization.spec_for("x").bits == 4
    # qwen3_next: top-level rope_theta / partial_rotary_factor and explicit layer_types
    d = dict(base, model_type="qwen3_next", rope_theta=5e5, partial_rotary_factor=0.25,
             layer_types=["linear_attention"] * 7 + ["full_attention"], intermediate_size=64,
             mlp_only_layers=[1], decoder_sparse_step=1)
    d.pop("rope_parameters")
    c = ModelConfig.from_dict(d)
    assert c.rope_theta == 5e5 and c.rotary_dim == 4 and not c.is_moe_layer(1) and c.is_moe_layer(0)


@pytest.mark.parametrize("change, msg", [
    ({"model_type": "llama"}, "not supported"),
    ({"num_attention_heads": 3}, "multiple of"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"hidden_size": "big"}, "hidden_size"),
])
def test_config_errors(change, msg):
    d = json.loads(json.dumps(PRESETS["tiny-qwen3-next"]))
    d.update(change)
    with pytest.raises(CheckpointError, match=msg):
        ModelConfig.from_dict(d)


def test_config_file_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_file(tmp_path)


# ---- layouts -----------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_all_formats_load_to_the_same_model(ckpts, preset):
    """hf-bf16 and mlx-bf16 are the same bf16 weights: equal after sanitize; mlx-q4 is their quantization."""
    w = {f: load_weights(ckpts[preset, f], ModelConfig.from_file(ckpts[preset, f]))
         for f in ("hf-bf16", "mlx-bf16", "mlx-q4")}
    assert w["hf-bf16"].layout == "hf" and w["mlx-bf16"].layout == "mlx" and w["mlx-q4"].layout == "mlx"
    assert set(w["hf-bf16"].tensors) == set(w["mlx-bf16"].tensors) == set(w["mlx-q4"].tensors)
    hf, mb, q = (x.dense_float32() for x in w.values())
    for k in hf:
        assert hf[k].shape == mb[k].shape == q[k].shape, k
        if k.endswith(("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")) or k == "norm":
            # HF adds 1 in float32, MLX files hold bf16(1 + w)
            np.testing.assert_allclose(hf[k], mb[k], atol=2 ** -8, err_msg=k)
        else:
            np.testing.assert_array_equal(hf[k], mb[k], err_msg=k)
        if isinstance(w["mlx-q4"][k], QuantizedTensor):
            assert np.abs(q[k] - mb[k]).max() <= np.abs(mb[k]).max() * 0.2 + 1e-3, k
    qt = w["mlx-q4"].tensors
    router = next(k for k in qt if k.endswith("mlp.gate"))
    assert qt[router].bits == 8 and qt["embed_tokens"].bits == 4


def test_sharded_checkpoint_loads(ckpts, tmp_path):
    src_dir = ckpts["tiny", "mlx-q4"]
    dst = copy(src_dir, tmp_path)
    src = TensorSource(dst)
    tensors = {k: np.array(src.get(k)) for k in src.keys()}
    del src
    for f in dst.glob("*.safetensors"):
        f.unlink()
    keys = sorted(tensors)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    wm = {}
    for fn, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(dst / fn), metadata={"format": "mlx"})
        wm.update({k: fn for k in ks})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    a = qm.Model.load(src_dir, backend="reference")
    b = qm.Model.load(dst, backend="reference")
    ids = [1, 5, 9, 2]
    np.testing.assert_array_equal(a.prefill(a.new_session(), ids), b.prefill(b.new_session(), ids))


# ---- strictness ----------------------------------------------------------------------------
def _first(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def test_missing_tensor(ckpts, tmp_path):
    d = copy(ckpts["tiny", "mlx-q4"], tmp_path)
    rewrite(d, lambda t: t.pop(_first(t, "linear_attn.dt_bias")))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.0\.linear_attn\.dt_bias'"):
        qm.Model.load(d, backend="reference")


def test_wrong_shape(ckpts, tmp_path):
    d = copy(ckpts["tiny", "hf-bf16"], tmp_path)
    def edit(t):
        k = _first(t, "post_attention_layernorm.weight")
        t[k] = np.concatenate([t[k], t[k][:1]])
    rewrite(d, edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*post_attention_layernorm\.weight': shape"):
        qm.Model.load(d, backend="reference")


@pytest.mark.parametrize("fmt", ["mlx-q4", "hf-bf16"])
@pytest.mark.parametrize("field,value,tensor", [("hidden_size", 256, "embed_tokens"), ("vocab_size", 1024, "embed_tokens"),
                                                ("moe_intermediate_size", 128, "mlp")])
def test_an_edited_config_dimension_is_named_not_blamed_on_quantization(ckpts, tmp_path, fmt, field, value, tensor):
    """config.json's dimension edited under the same weights: the message says the tensor's shape does not
    match what config.json's dimensions give it and names the field (quantized too: read at the config's
    widths the tensor is whole, so its bits are not the problem)."""
    d = copy(ckpts["tiny", fmt], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"][field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json's dimensions give it") as e:
        qm.Model.load(d, backend="reference")
    msg = str(e.value)
    assert f"tensor '" in msg and tensor in msg and "does not match" in msg and "config.json's dimensions" in msg, msg
    assert "bit" not in msg.split("does not match")[1] and "packed width" not in msg, msg
    if (fmt, field) != ("hf-bf16", "moe_intermediate_size"):   # HF's fused gate_up_proj has 2 * it: no one field
        assert f"config.json's {field} is {value} but the tensor has" in msg, msg


def test_wrong_dtype(ckpts, tmp_path):
    d = copy(ckpts["tiny", "mlx-q4"], tmp_path)
    def edit(t):
        k = _first(t, "linear_attn.norm.weight")
        t[k] = t[k].astype(np.float32).astype(np.int32)
    rewrite(d, edit)
    with pytest.raises(CheckpointError, match=r"tensor '.*linear_attn\.norm\.weight': dtype I32"):
        qm.Model.load(d, backend="reference")


def test_quantized_missing_biases_and_wrong_bits(ckpts, tmp_path):
    d = copy(ckpts["tiny", "mlx-q4"], tmp_path)
    rewrite(d, lambda t: t.pop(_first(t, "o_proj.biases")))
    with pytest.raises(CheckpointError, match=r"o_proj\.weight'.*lacks '.*o_proj\.biases'"):
        qm.Model.load(d, backend="reference")
    # a 4-bit router contradicts the 8-bit per-path override in config.json
    d2 = tmp_path / "ck2"
    shutil.copytree(ckpts["tiny", "mlx-q4"], d2)
    def edit(t):
        from qwenmetal.quant import quantize
        stem = _first(t, "mlp.gate.weight")[: -len(".weight")]
        w = np.asarray(qm.weights.QuantizedTensor(t[stem + ".weight"], t[stem + ".scales"], t[stem + ".biases"],
                                                  8, 64).dequantize())
        t[stem + ".weight"], t[stem + ".scales"], t[stem + ".biases"] = quantize(w, 4, 64)
    rewrite(d2, edit)
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight'.*4-bit group 64.*8-bit"):
        qm.Model.load(d2, backend="reference")


def test_unknown_leftover_tensor_but_mtp_is_dropped(ckpts, tmp_path):
    """A stray mtp.* tensor is an incomplete head, ignored (Weights.mtp_error says why); a stray vision tensor is
    refused (the tower is read strictly, tests/test_vision_reference.py), as is any other unknown tensor."""
    d = copy(ckpts["tiny", "hf-bf16"], tmp_path)
    rewrite(d, lambda t: t.update({"mtp.fc.weight": np.zeros((4, 4), np.float32)}))
    qm.Model.load(d, backend="reference")
    rewrite(d, lambda t: t.update({"model.visual.patch_embed.weight": np.zeros((2,), ml_dtypes.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"unexpected vision tensor 'model\.visual\.patch_embed\.weight'"):
        qm.Model.load(d, backend="reference")
    rewrite(d, lambda t: t.pop("model.visual.patch_embed.weight"))
    rewrite(d, lambda t: t.update({"model.layers.0.mlp.mystery.weight": np.zeros((4,), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.mystery\.weight'"):
        qm.Model.load(d, backend="reference")


def test_truncated_file_and_bad_header(ckpts, tmp_path):
    d = copy(ckpts["tiny", "mlx-q4"], tmp_path)
    f = next(d.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*': data ends at byte"):
        qm.Model.load(d, backend="reference")
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated file"):
        qm.Model.load(d, backend="reference")
    n = int.from_bytes(data[:8], "little")
    f.write_bytes(data[:8] + b"{" * n + data[8 + n:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header: invalid JSON"):
        qm.Model.load(d, backend="reference")
    f.write_bytes((10 ** 12).to_bytes(8, "little") + data[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: bad header length"):
        qm.Model.load(d, backend="reference")


def test_missing_config_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        qm.Model.load(tmp_path, backend="reference")
    with pytest.raises(CheckpointError, match="no such directory"):
        qm.Model.load(tmp_path / "nope" / "deeper", backend="reference")
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        qm.Model.load(tmp_path, backend="reference")


def test_unknown_backend(ckpts):
    with pytest.raises(ValueError, match="unknown backend"):
        qm.Model.load(ckpts["tiny", "mlx-q4"], backend="cuda")


def test_weights_are_memory_mapped_views(ckpts):
    w = load_weights(ckpts["tiny", "mlx-q4"], ModelConfig.from_file(ckpts["tiny", "mlx-q4"]))
    e = w["embed_tokens"]
    assert isinstance(e, QuantizedTensor)
    assert not e.weight.flags.owndata and not e.weight.flags.writeable


def test_core_dequantize_matches_numpy():
    from qwenmetal import _core
    from qwenmetal.quant import dequantize, quantize
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        for gs in (32, 64, 128):
            w = rng.normal(size=(7, 256)).astype(np.float32)
            q, s, b = quantize(w, bits, gs)
            ref = dequantize(q, s, b, bits, gs)
            got = _core.dequantize_affine(np.ascontiguousarray(q), s.astype(np.float32), b.astype(np.float32),
                                          bits, gs)
            np.testing.assert_array_equal(got, ref)
    with pytest.raises(ValueError, match="group_size"):
        _core.dequantize_affine(q, s.astype(np.float32), b.astype(np.float32), 8, 48)


def _with_header(f, header: str, data: bytes) -> None:
    hb = header.encode()
    f.write_bytes(len(hb).to_bytes(8, "little") + hb + data)


@pytest.mark.parametrize("entry, msg", [
    ('{"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}', r"unsupported dtype \['F32'\]"),
    ('{"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}', "malformed shape"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}', "malformed shape"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}', "malformed shape"),
    ('{"dtype": "F32", "shape": [18446744073709551617], "data_offsets": [0, 8]}', "needs 73786976294838206468"),
    ('{"dtype": "F32", "shape": [1099511627776], "data_offsets": [0, 4398046511104]}', "data ends at byte"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "x": {"dtype": "F32", "shape": [2], '
     '"data_offsets": [0, 8]}', "duplicate key 'x'"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": [1]', "'__metadata__' must map"),
    ('{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"a": 1}', "'__metadata__' must map"),
])
def test_malformed_header_entries(tmp_path, entry, msg):
    """Found by tests/test_fuzz.py on the earlier parser: each used to raise TypeError/OverflowError or pass."""
    from qwenmetal.safetensors_io import SafetensorsFile
    import tracemalloc
    f = tmp_path / "m.safetensors"
    _with_header(f, '{"x": ' + entry + "}", b"\0" * 8)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=rf"{f}: .*{msg}"):
            SafetensorsFile(f)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20      # refused before allocating what it claims
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("index, msg", [
    ({"weight_map": {"a": 3}}, "'weight_map' must map tensor names to file names"),
    ({"weight_map": {"a": ["x"]}}, "'weight_map' must map"),
    ({"weight_map": []}, "'weight_map' must map"),
    ([1], "'weight_map' must map"),
    ({"weight_map": {"a": ".."}}, "shard name '..' must be a plain file name"),
    ({"weight_map": {"a": "config.json"}}, r"config\.json: bad header length|config\.json: .*header"),
])
def test_malformed_index(ckpts, tmp_path, index, msg):
    d = copy(ckpts["tiny", "mlx-q4"], tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=msg):
        TensorSource(d)
    (d / "model.safetensors.index.json").write_bytes(b"\x80{}")
    with pytest.raises(CheckpointError, match=r"index\.json: invalid JSON: 'utf-8' codec"):
        TensorSource(d)


@pytest.mark.parametrize("edit, msg", [
    ({"rope_parameters": [1]}, "'rope_parameters' must be an object"),
    ({"rope_parameters": {"rope_theta": None}}, "'rope_theta' must be a number"),
    ({"partial_rotary_factor": "x", "rope_parameters": None}, "'partial_rotary_factor' must be a number"),
    ({"head_dim": "8"}, "'head_dim' must be a non-negative integer"),
    ({"num_hidden_layers": 10**12, "layer_types": None}, "more than 65536"),
    ({"layer_types": "linear_attention"}, "layer_types must list"),
    ({"attn_output_gate": "false"}, "'attn_output_gate' must be true or false"),
    ({"rms_norm_eps": [1e-6]}, "'rms_norm_eps' must be a number"),
])
def test_config_field_types(edit, msg):
    cfg = json.loads(json.dumps(PRESETS["tiny"]))
    t = cfg["text_config"] if "text_config" in cfg else cfg
    t.update(edit)
    with pytest.raises(CheckpointError, match=msg):
        ModelConfig.from_dict(cfg)


def test_config_file_errors(tmp_path):
    f = tmp_path / "config.json"
    for text, msg in ((b"\xff", "invalid JSON: 'utf-8' codec"), (b"[" * 100000, "nested too deeply"),
                      (b'{"a": 1, "a": 2}', "duplicate key 'a'"), (b'{"a": NaN}', "NaN is not valid JSON"),
                      (b"1" * 5000, "invalid JSON: Exceeds the limit")):
        f.write_bytes(text)
        with pytest.raises(CheckpointError, match=rf"{f}: .*{msg}"):
            ModelConfig.from_file(f)


@pytest.mark.parametrize("fmt, bits, expert_bits", [("mlx-q3", 3, 3), ("mlx-q6", 6, 6), ("mlx-q4-e2", 4, 2)])
def test_every_width_and_mixed_expert_widths_load(tmp_path, fmt, bits, expert_bits):
    """Each tensor's width comes from its shapes and agrees with config.json's per-path spec; the values
    are the quantization of the bf16 weights at that width."""
    from qwenmetal.quant import quantize
    d = make_checkpoint(tmp_path / fmt, "tiny", fmt, seed=0)
    w = load_weights(d, ModelConfig.from_file(d / "config.json"))
    assert (w["embed_tokens"].bits, w["layers.0.linear_attn.in_proj_qkv"].bits) == (bits, bits)
    assert w["layers.0.mlp.gate"].bits == w["layers.0.mlp.shared_expert_gate"].bits == 8
    for i in range(4):
        for m in ("gate_proj", "up_proj", "down_proj"):
            t = w[f"layers.{i}.mlp.switch_mlp.{m}"]
            assert (t.bits, t.group_size) == (expert_bits, 64)
        assert w[f"layers.{i}.mlp.shared_expert.down_proj"].bits == bits
    dense = load_weights(ref := make_checkpoint(tmp_path / "bf16", "tiny", "mlx-bf16", seed=0),
                         ModelConfig.from_file(ref / "config.json"))
    for name in ("layers.3.mlp.switch_mlp.down_proj", "layers.3.self_attn.o_proj"):
        t = w[name]
        for got, want in zip((t.weight, t.scales, t.biases), quantize(np.asarray(dense[name]), t.bits, 64)):
            assert got.tobytes() == want.tobytes(), name


def test_mixed_width_contradicting_config_is_refused(tmp_path):
    d = make_checkpoint(tmp_path / "e2", "tiny", "mlx-q4-e2", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    path = "language_model.model.layers.1.mlp.switch_mlp.up_proj"
    for block in ("quantization", "quantization_config"):
        del cfg[block][path]                 # the config now says 4 bits for a 2-bit expert stack
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"switch_mlp\.up_proj\.weight'.*2-bit group 64.*4-bit group 64"):
        load_weights(d, ModelConfig.from_file(d / "config.json"))
    for block in ("quantization", "quantization_config"):
        cfg[block][path] = {"group_size": 64, "bits": 7}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"switch_mlp\.up_proj' 'bits' is 7: MLX affine quantization has bits"):
        ModelConfig.from_file(d / "config.json")
