"""`qwenmetal selftest` on this machine: no Metal device here, so it runs on the simulator and must pass
(every kernel compiled, each family's check, the graph against the CPU backend and the bf16 reference)."""
from qwenmetal import cli, selftest


def test_selftest_passes_on_the_simulator(capsys):
    assert cli.main(["selftest"]) == 0
    out = capsys.readouterr().out
    assert "simulator-verified, hardware-unverified" in out
    assert "0 failed" in out and "compile gate" in out and "decode graph, bfloat build" in out


def test_a_failing_check_fails_the_report(monkeypatch):
    def broken(dev):
        raise RuntimeError("planted")
    monkeypatch.setattr(selftest, "FAMILY_CHECKS", [("planted", broken)])
    r = selftest.run(sim=True)
    assert r.failed and "FAIL" in r.text() and "planted" in r.text()
