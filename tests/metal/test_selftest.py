"""`qwenmetal selftest` on this machine: no Metal device here, so it runs on the simulator and must pass
(every kernel compiled, each family's check, the graph against the CPU backend and the bf16 reference, the
timed family runs at tiny shapes, the 4K prediction) and write every section of its JSON. The parts only a
Mac runs are exercised here on stand-ins: the chip table and the % of peak arithmetic on device-info dicts,
the family runs at the real widths on an encode-only device, Apple's compile gate on a device whose
compile_all reports a failure, and the measured 4K section on the simulator backend."""
import json

import numpy as np
import pytest

from qwenmetal import _core, cli, selftest
from qwenmetal.bench.cost import CHIP_BANDWIDTH_GBS, CHIP_PEAK_TFLOPS

g = _core.gpu
M1_MAX = {"name": "Apple M1 Max", "family": "apple7", "max_buffer_length": 2**34, "max_threads_per_threadgroup": 1024,
          "max_threadgroup_memory": 32768, "simd_reductions": True, "simdgroup_matrix": True, "tensor_ops": False,
          "executes": True, "working_set": 48 << 30}


def test_selftest_passes_on_the_simulator(capsys, tmp_path):
    out_json = tmp_path / "selftest.json"
    assert cli.main(["selftest", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "simulator-verified, hardware-unverified" in out
    assert "0 failed" in out and "compile gate: quant" in out and "decode graph, bfloat build" in out
    assert "SIMULATOR times" in out and "measured: skipped" in out and "modelled decode, these 4 layers: M1 Max" in out
    d = json.loads(out_json.read_text())
    assert d["schema"] == selftest.SCHEMA and d["label"] == selftest.SIM_LABEL
    assert d["simulated"] and not d["failed"] and d["summary"]["failed"] == 0
    assert {"qwenmetal", "python", "numpy", "platform"} <= set(d["versions"])
    lim = d["device"]["limits"]
    assert d["device"]["info"]["family"] == "simulator" and d["device"]["chip"] is None
    assert {"max_buffer_length", "working_set", "max_threads_per_threadgroup"} <= set(lim)
    assert len(lim["max_threads_per_pipeline"]) > 200 and lim["pipelines_below_declared"] == {}
    fams = {r["family"]: r for r in d["compile"]}
    assert set(fams) == {"attention", "gdn", "gemm", "gemm_tensor", "moe", "norm", "quant", "sample", "vision"}
    assert fams["quant"]["status"] == "pass" and "did not run" in fams["quant"]["compiler"]
    assert fams["gemm_tensor"]["status"] == "skipped"
    assert any(c["name"] == "decode graph, float build" and c["status"] == "pass" for c in d["checks"])
    timed = {t["family"]: t for t in d["timings"]}
    assert set(timed) == set(fams)
    for fam, t in timed.items():
        if fam == "gemm_tensor":
            assert t["status"] == "skipped"
            continue
        assert t["status"] == "pass" and t["simulated"] and not t["real_shapes"]
        assert t["bytes"] > 0 and t["seconds"] > 0 and t["gbs"] > 0 and t["pct_of_peak_gbs"] is None
    assert timed["gemm"]["flops"] > 0 and timed["gemm"]["bound"] == "compute"
    k = d["four_k"]
    assert k["context"] == 4096 and k["layers"] == selftest.MEASURE_LAYERS
    assert k["measured"]["status"] == "skipped" and "comparison" not in k
    for key, layers in (("prediction", selftest.MEASURE_LAYERS), ("full_model_prediction", selftest.FULL_LAYERS)):
        p = k[key]
        assert p["status"] == "pass" and p["layers"] == layers
        assert set(p["decode"]["modelled_tok_s"]) == set(CHIP_BANDWIDTH_GBS) == set(p["prefill"]["modelled_tok_s"])


def test_a_failing_check_fails_the_report(monkeypatch):
    def broken(dev):
        raise RuntimeError("planted")
    monkeypatch.setattr(selftest, "FAMILY_CHECKS", [("planted", broken)])
    monkeypatch.setattr(selftest, "FAMILY_RUNS", [("norm", selftest.run_norm, False)])
    monkeypatch.setattr(selftest, "check_graph", lambda backend, dtype: (0.0, "skipped here", True))
    r = selftest.run(sim=True)
    assert r.failed and "FAIL" in r.text() and "planted" in r.text()


def test_a_failing_timed_run_fails_the_report():
    r = selftest.Report(dict(g.SimDevice().info))
    assert not r.failed
    r.timings = [{"family": "gemm", "status": "FAIL", "error": "DeviceError: planted"}]
    assert r.failed and "[   FAIL] gemm: DeviceError: planted" in r.text() and "1 failed" in r.text()


def test_chip_lookup():
    assert selftest.chip_of(M1_MAX).name == "M1 Max"
    assert selftest.chip_of({**M1_MAX, "name": "Apple M4 Pro"}).name == "M4 Pro"
    assert selftest.chip_of({**M1_MAX, "name": "Apple M3"}).name == "M3"
    assert selftest.chip_of({**M1_MAX, "name": "Apple M2 Ultra"}).fp32_tflops == 27.2
    for unknown in ("Apple M9 Hyper", "Apple Paravirtual device", "AMD Radeon Pro 5500M"):
        assert selftest.chip_of({**M1_MAX, "name": unknown}) is None
    assert selftest.chip_of({**M1_MAX, "family": "simulator"}) is None      # the simulator is no chip
    # the Max chips are the cost model's figures, not a second copy
    for name, bw in CHIP_BANDWIDTH_GBS.items():
        c = selftest.APPLE_GPUS[name]
        assert c.bandwidth_gbs == bw and c.model_tflops == CHIP_PEAK_TFLOPS[name]
    assert selftest.APPLE_GPUS["M5 Max"].route == "tensor" and selftest.APPLE_GPUS["M5 Max"].fp32_tflops is None
    assert all(c.bandwidth_gbs > 0 for c in selftest.APPLE_GPUS.values())


def test_percent_of_peak():
    m1max = selftest.chip_of(M1_MAX)                      # 400 GB/s, 10.4 FP32 TFLOP/s
    r = selftest.rates(200e9, 5.2e12, 1.0, m1max)
    assert r["gbs"] == pytest.approx(200.0) and r["pct_of_peak_gbs"] == pytest.approx(50.0)
    assert r["tflops"] == pytest.approx(5.2) and r["pct_of_peak_tflops"] == pytest.approx(50.0)
    r = selftest.rates(100e9, 0, 0.5, selftest.APPLE_GPUS["M3"])  # no published FP32 peak: GB/s only
    assert r["pct_of_peak_gbs"] == pytest.approx(200.0) and r["pct_of_peak_tflops"] is None
    r = selftest.rates(1e12, 36.8e12, 1.0, selftest.APPLE_GPUS["M5 Max"], peak="tensor")
    assert r["pct_of_peak_tflops"] == pytest.approx(50.0)
    r = selftest.rates(1e9, 1e12, 1.0, None)             # unknown chip: achieved figures only
    assert r["gbs"] == pytest.approx(1.0) and r["pct_of_peak_gbs"] is None and r["peak_gbs"] is None
    assert selftest.rates(1e9, 1e12, None, m1max)["gbs"] is None        # not timed


def test_family_runs_at_the_real_widths_encode_only():
    """What a Mac times, encoded on an encode-only device (tensor ops claimed, so gemm_tensor too): every
    family at the real widths, the declared bytes and FLOPs per run, the input copies past the caches."""
    dev = g.SimDevice(execute=False, tensor_ops=True)
    res = {t["family"]: t for t in selftest.time_families(dev, real=True, chip=selftest.APPLE_GPUS["M5 Max"])}
    assert {t["status"] for t in res.values()} == {"pass"}, res
    for t in res.values():
        assert t["real_shapes"] and t["seconds"] is None and t["gbs"] is None
        if t["bound"] == "bandwidth":                     # the bytes of all copies are past the caches
            assert t["bytes"] / t["runs"] * t["copies"] >= 0.45 * selftest.ROTATE_BYTES, t
    q = res["quant"]                                      # the LM head: 4-bit codes + bf16 scales and biases
    assert q["bytes_read"] // q["runs"] >= 248320 * 2048 // 2 + 2 * 248320 * 2048 // 64 * 2
    assert res["gemm"]["flops"] == res["gemm"]["runs"] * 2 * 512 * 8192 * 2048 == res["gemm_tensor"]["flops"]
    assert res["moe"]["copies"] == 256 // 8


class FakeMac:
    """A MetalDevice stand-in over an encode-only simulator: compile_all reports one family with a warning,
    one rejected by the compiler; the norm pipelines are lowered to 512 threads."""

    def __init__(self):
        self._d = g.SimDevice(execute=False)
        self.info = {**self._d.info, **M1_MAX}
        self.norm = [k for k in ("rmsnorm_f32", "rmsnorm_bf16") if self._d.has_kernel(k)]

    def compile_all(self):
        return [{"family": "norm", "origin": "metal/norm.metal", "ok": True, "log": "warning: planted warning",
                 "seconds": 0.5, "pipeline_seconds": 0.25, "pipelines": len(self.norm), "language_version": "3.1",
                 "kernels": self.norm},
                {"family": "quant", "origin": "metal/quant.metal", "ok": False, "seconds": 0.5, "pipeline_seconds": 0,
                 "log": "metal/quant.metal:12:3: error: planted error", "pipelines": 0, "language_version": "3.1",
                 "kernels": []}]

    @staticmethod
    def embedded_families():
        return ["gemm_tensor", "norm", "quant"]

    def prepare(self, k):
        self._d.prepare(k)

    def max_threads(self, k):
        return 512 if k.startswith("rmsnorm") else self._d.max_threads(k)


def test_apple_compile_gate_reports_the_compiler_log():
    dev = FakeMac()
    assert dev.norm
    r = selftest.Report(dict(dev.info), backend="metal")
    selftest._compile_checks(r, dev)
    status = {c.name: c.status for c in r.checks}
    assert status == {"compile gate: norm": "pass", "compile gate: quant": "FAIL",
                      "compile gate: gemm_tensor": "skipped"}
    text = r.text()
    assert r.failed and r.label == "measured on Apple M1 Max" and "chip: M1 Max: 400 GB/s" in text
    assert "| warning: planted warning" in text and "| metal/quant.metal:12:3: error: planted error" in text
    assert "MSL 3.1" in text and "Apple's compiler did not run" not in text
    assert r.below_declared == {k: {"device": 512, "declared": 1024} for k in dev.norm}
    d = r.to_json()
    assert d["device"]["chip"]["name"] == "M1 Max" and d["device"]["limits"]["pipelines_below_declared"]
    assert [f["status"] for f in d["compile"]] == ["pass", "FAIL", "skipped"]
    assert "planted error" in d["compile"][1]["log"]


def test_measured_4k_section_on_the_simulator_backend(monkeypatch):
    """The Mac's 4K path (checkpoint, load, timed prefill and decode, measured / modelled) run on metal-sim over
    the tiny checkpoint at a short context, as if the device were an M1 Max."""
    from qwenmetal.testing import cached_checkpoint
    tiny = cached_checkpoint("tiny", "mlx-q4", seed=0)
    built = []                                # (selftest's own name: patching the bench module's would not reach it)
    monkeypatch.setattr(selftest, "ensure_checkpoint", lambda cfg, log=None: built.append(cfg) or tiny)
    r = selftest.Report(dict(M1_MAX), backend="metal-sim")
    k = selftest.four_k(r, layers=4, context=16, decode_steps=2, repeats=1)
    m = k["measured"]
    assert m["status"] == "pass", m
    assert len(built) == 1 and m["layers"] == 4 and k["checkpoint"] == str(tiny)     # the tiny one, not a real-width build
    assert m["prefill"]["tokens"] == 16 and m["decode"]["context"] == 16 and m["decode"]["steps"] == 2
    for key in ("decode", "prefill"):
        c = k["comparison"][key]
        assert c["chip"] == "M1 Max" and c["measured_tok_s"] > 0
        assert c["ratio"] == pytest.approx(c["measured_tok_s"] / c["modelled_tok_s"])
        assert c["modelled_tok_s"] == k["prediction"][key]["modelled_tok_s"]["M1 Max"]
    r.four_k = k
    assert "decode   measured" in r.text() and "measured/modelled" in r.text()
    json.dumps(r.to_json(), default=selftest._jsonable)


def test_prediction_for_a_chip_outside_the_cost_model():
    """The detected chip is modelled beside the Max chips: decode from its bandwidth, prefill from its peak
    (none for a chip without a published one)."""
    from qwenmetal.bench.checkpoint import real_config
    cfg = real_config(4)
    m1 = selftest.predict(cfg, selftest.APPLE_GPUS["M1"])
    m3 = selftest.predict(cfg, selftest.APPLE_GPUS["M3"])
    base = m1["decode"]["modelled_tok_s"]
    assert base["M1"] < base["M1 Max"] and m3["decode"]["modelled_tok_s"]["M3"] < base["M1 Max"]
    assert np.isclose(base["M1"], 1 / (m1["decode"]["bytes_per_token"] / 68.25e9
                                       + m1["decode"]["levels"] * m1["level_latency_us"] * 1e-6))
    assert 0 < m1["prefill"]["modelled_tok_s"]["M1"] < m1["prefill"]["modelled_tok_s"]["M1 Max"]
    assert "M3" not in m3["prefill"]["modelled_tok_s"]
