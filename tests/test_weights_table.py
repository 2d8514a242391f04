"""The weights table both C++ engines read (qwenmetal.weights_table): tensors are spans of the checkpoint's
file mappings, used in place -- including HF's fused experts viewed as gate / up (a strided stack)."""
import os

import numpy as np

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
