"""The weights table both C++ engines read (qwenmetal.weights_table): tensors are spans of the checkpoint's
file mappings, used in place -- including HF's fused experts viewed as gate / up (a strided stack)."""
import json
import os

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.testing import cached_checkpoint
from qwenmetal.weights_table import virtual_weight_table, weight_table


def file_mappings(path, maps) -> set:
    """indices of the mappings that are whole safetensors files of the checkpoint (by size)"""
    sizes = {os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")}
    return {i for i, (_, _, n) in enumerate(maps) if n in sizes}


def test_mlx_tensors_are_spans_of_their_files():
    m = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend="reference")
    maps, tensors, keep = weight_table(m.weights)
    files = file_mappings(m.path, maps)
    t = tensors["layers.0.mlp.switch_mlp.gate_proj"]
    assert t["data"][0] in files and t["scales"][0] in files and t["stride"] == 0
    for d in tensors.values():
        for s in (d["data"], d["scales"], d["biases"]):
            if s is not None:
                assert s[1] + s[2] <= maps[s[0]][2]


def test_hf_fused_experts_are_used_in_place():
    """gate_proj / up_proj are views of HF's fused gate_up_proj: one span of the file with the stride of the
    fused matrix, no copy; the CPU engine owns no weight bytes and matches the reference."""
    path = cached_checkpoint("tiny", "hf-bf16", seed=0)
    ref = qm.Model.load(path, backend="reference")
    maps, tensors, keep = weight_table(ref.weights)
    g = tensors["layers.0.mlp.switch_mlp.gate_proj"]
    E, I, H = g["shape"]
    assert g["data"][0] in file_mappings(path, maps)
    assert g["stride"] == 2 * I * H * 2                       # [gate | up] rows of one expert, bf16
    cpu = qm.Model.load(path, backend="cpu", kv_dtype="float32", activations="float")
    assert cpu._backend.engine.owned_weight_nbytes == 0
    ids = [5, 17, 3]
    a, b = cpu.prefill(cpu.new_session(), ids), ref.prefill(ref.new_session(), ids)
    assert np.abs(a - b).max() / (b.max() - b.min()) < 1e-4


def test_virtual_table_has_the_real_sizes():
    from qwenmetal import bench
    from qwenmetal.config import ModelConfig
    c = ModelConfig.from_dict(bench.real_config(40))
    maps, tensors, sizes = virtual_weight_table(c)
    assert maps == [("virtual checkpoint", 0, maps[0][2])]
    assert 18e9 < sum(sizes.values()) < 21e9                 # the ~19.5 GB MLX 4-bit checkpoint


@pytest.mark.parametrize("fmt", ["mlx-q4-e2", "mlx-q3"])
def test_virtual_table_sizes_every_tensor_of_a_mixed_checkpoint(fmt):
    """The config alone (its quantization block: default width, expert and router overrides) sizes every
    tensor exactly as the checkpoint stores it."""
    from qwenmetal.config import ModelConfig
    from qwenmetal.weights import load_weights
    from qwenmetal.weights_table import config_widths
    path = cached_checkpoint("tiny", fmt, seed=0)
    w = load_weights(path, ModelConfig.from_file(path))
    widths = config_widths(w.config)
    assert widths == ({"bits": 4, "group_size": 64, "expert_bits": 2, "router_bits": 8} if fmt == "mlx-q4-e2"
                      else {"bits": 3, "group_size": 64, "router_bits": 8})
    _, _, sizes = virtual_weight_table(w.config, **widths)
    assert sizes == {k: t.nbytes for k, t in w.tensors.items()}


def test_qwen35_397b_from_its_config_alone(tmp_path, capsys):
    """Qwen3.5-397B-A17B's config parses like any size; the virtual table gives the released 4-bit
    checkpoint's size and Flash-MoE's expert blob; `qwenmetal info` reports them from a config-only
    directory, at 4 bits and with 2-bit experts."""
    from qwenmetal import bench
    from qwenmetal.cli import main
    from qwenmetal.config import ModelConfig
    cfg = bench.qwen35_397b_config()
    c = ModelConfig.from_dict(cfg)
    assert (c.num_hidden_layers, len(c.linear_attention_layers), len(c.full_attention_layers)) == (60, 45, 15)
    assert (c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4096, 512, 10, 1024)
    assert (c.linear_num_value_heads, c.linear_num_key_heads, c.shared_expert_intermediate_size) == (64, 16, 1024)
    _, _, sizes = virtual_weight_table(c)
    total = sum(sizes.values())
    # Flash-MoE's write-up: "209 GB at 4 bits" (binary GB: 207.7 GiB); mlx-community's card: ~223 GB (decimal)
    assert 205 * 2**30 < total < 211 * 2**30 and 222e9 < total < 224e9
    expert = sizes["layers.0.mlp.switch_mlp.gate_proj"] + sizes["layers.0.mlp.switch_mlp.up_proj"] + \
        sizes["layers.0.mlp.switch_mlp.down_proj"]
    assert expert == 512 * 7_077_888                         # Flash-MoE's 4-bit expert blob, per expert
    _, _, low = virtual_weight_table(c, expert_bits=2)
    assert sum(low[f"layers.59.mlp.switch_mlp.{m}"] for m in ("gate_proj", "up_proj", "down_proj")) == \
        512 * (3 * 1024 * 4096 * 2 // 8 + 3 * 1024 * 4096 // 64 * 4)    # 2-bit weights, bf16 scales + biases
    assert {k: v for k, v in low.items() if "switch_mlp" not in k} == \
        {k: v for k, v in sizes.items() if "switch_mlp" not in k}

    d = tmp_path / "397b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["info", "--model", str(d)]) == 0
    out = capsys.readouterr().out
    assert f"weights: {total / 1e9:.2f} GB ({total / 2**30:.2f} GiB)" in out and "7,077,888 bytes" in out
    assert "10 active per token over 60 MoE layers" in out
    assert main(["info", "--model", str(d), "--expert-bits", "2", "--memory-budget", "48GiB", "--hit-rate", "0.71"]) == 0
    out = capsys.readouterr().out
    assert f"weights: {sum(low.values()) / 1e9:.2f} GB" in out and "expert streaming: yes" in out
    assert "at hit rate 71.0% (given)" in out
    # on a checkpoint with weights the widths are the files': --bits is refused
    assert main(["info", "--model", str(cached_checkpoint("tiny", "mlx-q4", seed=0)), "--bits", "2"]) == 2
    assert "--bits / --expert-bits size a config-only directory" in capsys.readouterr().err


def test_config_widths_refuses_per_layer_expert_widths():
    """A recipe giving layers' experts different widths (mlx-lm's mixed_3_6) cannot be sized from one
    expert width: a CheckpointError, not a wrong total."""
    from qwenmetal.config import ModelConfig
    from qwenmetal.errors import CheckpointError
    from qwenmetal.testing import PRESETS
    from qwenmetal.weights_table import config_widths
    cfg = json.loads(json.dumps(PRESETS["tiny"]))
    p = "language_model.model.layers.{}.mlp.switch_mlp.down_proj"
    cfg["quantization"] = {"group_size": 64, "bits": 3, p.format(0): {"group_size": 64, "bits": 3},
                           p.format(3): {"group_size": 64, "bits": 6}}
    with pytest.raises(CheckpointError, match="different widths per layer: sizing it needs the weights"):
        config_widths(ModelConfig.from_dict(cfg))
