"""What the simulator counts that the cost model cannot see (docs/metal.md, "What the simulator counts"):
threadgroup-memory bank conflicts per SIMD-group access on planted access patterns with known answers,
threadgroups resident per core from the per-family limits, the efficiency model of bench.occupancy, and
`qwenmetal bench --backend metal-sim --kernels`. Modelled, not measured (simulator-verified,
hardware-unverified)."""
import json

import numpy as np
import pytest

from qwenmetal import cli
from qwenmetal import msl_sim as sim
from qwenmetal.bench import occupancy as occ

SRC = r"""
#include <metal_stdlib>
using namespace metal;
// lane i of the SIMD-group writes, then reads, tile[i * stride]: a column of a row-major tile with a row
// stride of `stride` words (0: every lane the same word, a broadcast)
kernel void column(device float* out [[buffer(0)]], constant uint& stride [[buffer(1)]],
                   uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float tile[32 * 64];
    tile[lane * stride] = float(lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[lane] = tile[lane * stride];
}
// an 8x8 float tile in threadgroup memory with a row stride of `stride` floats, read by simdgroup_load
kernel void sgload(device float* out [[buffer(0)]], constant uint& stride [[buffer(1)]],
                   uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float t[8 * 264];
    for (uint i = lane; i < 8 * 264; i += 32) t[i] = float(i / stride);   // 66 clean accesses
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 m;
    simdgroup_load(m, (threadgroup const float*)t, stride);
    simdgroup_store(m, out, 8);
}
"""


@pytest.fixture(scope="module")
def lib():
    return sim.compile(SRC)


@pytest.mark.parametrize("stride, degree", [(32, 32), (64, 32), (33, 1), (1, 1), (0, 1), (16, 16), (2, 2)])
def test_column_access_conflicts(lib, stride, degree):
    """A column of 32 rows: a row stride that is a multiple of 32 words puts every lane on one bank (degree
    32: 31 replays per access), 33 spreads them over all banks, a broadcast costs nothing; the write and the
    read are one SIMD-group access each."""
    out = np.zeros(64, np.float32)
    b = lib.dispatch("column", (1, 1, 1), (32, 1, 1), [out], sim.pack("I", stride), count_banks=True)["banks"]
    assert b["accesses"] == 2 and b["max_degree"] == degree
    assert b["replays"] == 2 * (degree - 1) and b["conflicted"] == (2 if degree > 1 else 0)
    np.testing.assert_array_equal(out[:32], np.arange(32) if stride else np.full(32, out[0]))


@pytest.mark.parametrize("stride, replays", [(8, 0), (256, 6), (260, 0), (264, 0)])
def test_simdgroup_load_rows(lib, stride, replays):
    """simdgroup_load of an 8x8 float tile: one SIMD-group access of 64 words (each lane its two elements),
    2 cycles at best. Rows 256 floats apart land on the same 8 banks (8 words per bank: 6 replays); padding the
    row by 16 bytes (260) or 32 (264) removes them. The fill before it is 66 conflict-free accesses."""
    out = np.zeros(64, np.float32)
    b = lib.dispatch("sgload", (1, 1, 1), (32, 1, 1), [out], sim.pack("I", stride), count_banks=True)["banks"]
    assert b["accesses"] == 66 + 1 and b["replays"] == replays
    np.testing.assert_array_equal(out.reshape(8, 8), np.repeat(np.arange(8, dtype=np.float32)[:, None], 8, 1))


def test_counting_is_off_by_default(lib):
    out = np.zeros(64, np.float32)
    assert "banks" not in lib.dispatch("column", (1, 1, 1), (32, 1, 1), [out], sim.pack("I", 32))


def test_resident_threadgroups_per_core():
    """Known answers of the per-family limits (64 KB threadgroup memory and 3072 threads per core)."""
    r = occ.resident_per_core(256, 24576, "Apple7")           # attention-prefill-like: memory-limited
    assert (r["resident"], r["by_threads"], r["by_memory"], r["limit"]) == (2, 12, 2, "threadgroup memory")
    assert occ.resident_per_core(1024, 640, "Apple9")["resident"] == 3          # thread-limited
    assert occ.resident_per_core(48, None, "Apple10")["resident"] == 48         # whole SIMD-groups: 64 threads
    assert occ.resident_per_core(128, 32768, "Apple8")["resident"] == 2


def test_efficiency_model():
    """The grid's fill of the cores and the conflict factor; a level of efficient dispatches costs what the
    bound says."""
    assert occ.fill(2, 40) == pytest.approx(0.05)
    assert occ.fill(80, 40) == 1.0 and occ.fill(41, 40) == pytest.approx(41 / 80)
    assert occ.dispatch_efficiency(40, 40, replays_per_access=1.0) == pytest.approx(0.5)
    big = {"kernel": "k", "threadgroups": (400, 1, 1), "bytes_read": 4e9, "bytes_written": 0, "flops": 0}
    small = dict(big, kernel="s", threadgroups=(2, 1, 1), bytes_read=1e7)
    at, model = occ.level_seconds([big], 400, 10, 40, 0.0)
    assert at == pytest.approx(model) == pytest.approx(0.01)
    at, model = occ.level_seconds([big, small], 400, 10, 40, 0.0)              # the small one overlaps
    assert model == pytest.approx(at)
    at, model = occ.level_seconds([small], 400, 10, 40, 0.0)                   # alone, on 2 of 40 cores
    assert model == pytest.approx(20 * at)
    at, model = occ.level_seconds([big], 400, 10, 40, 0.0, {"k": 0.5})
    assert model == pytest.approx(1.5 * at)


def test_bench_kernels_table(tmp_path, capsys):
    """`bench --kernels` counts on the tiny model and prints the per-kernel table (a 4-layer real-width config: three GDN layers and an attention layer,
    keeps it quick); the attention prefill's unpadded K/V rows show as conflicts."""
    out = tmp_path / "k.json"
    assert cli.main(["bench", "--backend", "metal-sim", "--kernels", "--layers", "4", "--prefill-chunk", "256",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "replay/acc" in text and "hardware-unverified" in text and "attn_prefill" in text
    d = json.loads(out.read_text())["kernels"]
    rows = {(e["phase"], e["kernel"]): e for e in d["kernels"]}
    qmv = [e for (ph, k), e in rows.items() if ph == "decode" and k.startswith("qmv_")]
    assert qmv and all(e["counted"] and e["threadgroup_memory"] is not None for e in qmv)
    assert all(set(e["resident_per_core"]) == set(occ.GPU_FAMILIES) for e in d["kernels"])
    assert all(0 < f <= 1 for e in d["kernels"] for f in e["fraction_of_bound"].values())
    for chip, v in d["decode"]["at_bound"].items():
        assert d["decode"]["occupancy_and_conflicts"][chip] <= d["decode"]["occupancy_only"][chip] <= v * 1.0001
