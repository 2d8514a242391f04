"""The README's first command: `qwenmetal demo` works offline on a fresh install; `info` too."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def run(args, tmp_path):
    env = dict(os.environ, QWENMETAL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    exe = shutil.which("qwenmetal")
    if os.environ.get("CI") == "true":
        assert exe, "the qwenmetal console script is not installed"
    cmd = [exe] if exe else [sys.executable, "-m", "qwenmetal.cli"]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300)


def test_demo_offline(tmp_path):
    r = run(["demo", "--max-tokens", "12"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "RANDOM weights" in r.stdout and "mlx-community/Qwen3.6-35B-A3B-4bit" in r.stdout
    assert re.search(r"generated \d+ tokens: [\d.]+ tok/s decode", r.stdout)
    # the checkpoint is cached: a second run reuses it
    cached = list((tmp_path / "cache").rglob("config.json"))
    assert len(cached) == 1
    r2 = run(["demo", "--max-tokens", "4", "--temperature", "0.8", "--seed", "3"], tmp_path)
    assert r2.returncode == 0, r2.stderr
    assert list((tmp_path / "cache").rglob("config.json")) == cached


def test_info_and_errors(tmp_path):
    from qwenmetal.testing import make_checkpoint
    d = make_checkpoint(tmp_path / "ck", config="tiny-qwen3-next", format="mlx-q4")
    r = run(["info", "--model", str(d)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "qwen3_next" in r.stdout and "bytes/token" in r.stdout
    r = run(["info", "--model", str(tmp_path / "missing")], tmp_path)
    assert r.returncode == 2 and "no such directory" in r.stderr
    r = run(["demo", "--backend", "cuda"], tmp_path)
    assert r.returncode == 2 and "unknown backend" in r.stderr


def test_readme_commands_and_ci():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert "pip install . && qwenmetal demo\n" in blocks
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), f".ci/run must run the README's test command {test_cmd!r}"
