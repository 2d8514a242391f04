"""The README's first command: `qwenmetal demo` works offline on a fresh install; `info`, `generate` and the
interactive `chat` too (convert: tests/test_convert.py; serve: tests/test_server.py)."""
import os
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def run(args, tmp_path, stdin=None):
    env = dict(os.environ, QWENMETAL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    exe = shutil.which("qwenmetal")
    if os.environ.get("CI") == "true":
        assert exe, "the qwenmetal console script is not installed"
    cmd = [exe] if exe else [sys.executable, "-m", "qwenmetal.cli"]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300,
                          input=stdin if stdin is not None else "")


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


# ---- generate / chat ----------------------------------------------------------------------------------
def _ckpt(tmp_path):
    from qwenmetal.testing import make_checkpoint
    return make_checkpoint(tmp_path / "ck", config="tiny", format="mlx-q4", seed=7)


def test_generate_command(tmp_path):
    import qwenmetal as qm

    d = _ckpt(tmp_path)
    m = qm.Model.load(d, backend="reference")
    want = "".join(o.text for o in m.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True))
    ref = ["--backend", "reference"]
    r = run(["generate", "--model", str(d), "--prompt", "Hello", "--max-tokens", "8", "--temperature", "0",
             "--ignore-eos"] + ref, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert re.search(r"prompt \d+ tokens \(0 cached\).*generated 8 tokens.*finish: length", r.stderr)
    stop = want[2:4]
    r = run(["generate", "--model", str(d), "--prompt", "Hello", "--max-tokens", "8", "--temperature", "0",
             "--ignore-eos", "--stop", stop, "--quiet"] + ref, tmp_path)
    assert r.stdout == want[:want.index(stop)] + "\n" and r.stderr == ""
    ids, head, _ = m.chat_prompt([{"role": "user", "content": "Hi there"}], enable_thinking=False)
    want = "".join(o.text for o in m.generate(ids, max_tokens=6, temperature=0))
    r = run(["generate", "--model", str(d), "--chat", "--no-thinking", "--max-tokens", "6", "--temperature", "0",
             "--quiet"] + ref, tmp_path, stdin="Hi there")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    r = run(["generate", "--model", str(d), "--prompt", "x", "--temperature", "-1"], tmp_path)
    assert r.returncode == 2 and "temperature" in r.stderr
    r = run(["generate", "--model", str(d), "--prompt", "x", "--system", "be brief"] + ref, tmp_path)
    assert r.returncode == 2 and "--system needs --chat" in r.stderr
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    for extra in ([], ["--chat", "--no-thinking"]):          # the output, or the chat answer, is the schema's JSON
        r = run(["generate", "--model", str(d), "--prompt", "A number:", "--max-tokens", "20", "--temperature", "0",
                 "--json-schema", str(tmp_path / "schema.json"), "--quiet"] + extra + ref, tmp_path)
        assert r.returncode == 0, r.stderr
        assert 0 <= json.loads(r.stdout)["n"] <= 99
    r = run(["generate", "--model", str(d), "--prompt", "x", "--json-schema", '{"type": "nope"}'] + ref, tmp_path)
    assert r.returncode == 2 and "--json-schema: Invalid type" in r.stderr
    r = run(["generate", "--model", str(d), "--chat", "--thinking-budget", "70", "--max-tokens", "72", "--temperature",
             "0", "--ignore-eos", "--quiet"] + ref, tmp_path, stdin="Hi there")   # (the note is 66 tokens here)
    assert r.returncode == 0 and "thinking directly now.\n</think>" in r.stdout, r.stderr
    r = run(["generate", "--model", str(d), "--prompt", "x", "--thinking-budget", "-2"] + ref, tmp_path)
    assert r.returncode == 2 and "thinking_budget must be an integer >= 0" in r.stderr


def test_generate_streams_experts_with_the_same_tokens(tmp_path):
    """--expert-slots / --memory-budget reach the backend: a streamed run prints the resident run's text and
    the expert cache's statistics; a budget below the resident weights is a one-line error."""
    d = _ckpt(tmp_path)
    args = ["generate", "--model", str(d), "--prompt", "Hello", "--max-tokens", "8", "--temperature", "0",
            "--ignore-eos", "--backend", "cpu"]
    resident = run(args + ["--memory-budget", "none"], tmp_path)
    assert resident.returncode == 0, resident.stderr
    assert "experts streamed" not in resident.stderr
    streamed = run(args + ["--expert-slots", "1", "--expert-policy", "lru"], tmp_path)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == resident.stdout
    assert re.search(r"experts streamed: 1 slots/layer \(lru\), hit rate [\d.]+ %", streamed.stderr)
    r = run(args + ["--memory-budget", "10KB"], tmp_path)
    assert r.returncode == 2 and "memory_budget" in r.stderr and "resident weights" in r.stderr
    r = run(["info", "--model", str(d), "--expert-slots", "2"], tmp_path)
    assert r.returncode == 0 and "2 of 8" in r.stdout, r.stdout


def test_stop_escapes():
    """`--stop "\\n\\n"` (as the README writes it) is a blank line; other backslashes are kept."""
    from qwenmetal.options import unescape_stop
    assert unescape_stop("\\n\\n") == "\n\n"
    assert unescape_stop("a\\tb\\r\\\\") == "a\tb\r\\"
    assert unescape_stop("\\d+ é") == "\\d+ é"


def test_chat_command(tmp_path):
    d = _ckpt(tmp_path)
    save = tmp_path / "conv.safetensors"
    script = (f"Hello\n/stats\n/save {save}\n/reset\n/history\n/load {save}\n/history\nAnd now?\n/nope\n/exit\n")
    r = run(["chat", "--model", str(d), "--max-tokens", "5", "--temperature", "0", "--system", "Be brief.",
             "--backend", "reference"], tmp_path, stdin=script)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "prompt " in out and "finish: " in out                                    # /stats
    assert "(saved 3 messages" in out and "(conversation cleared)" in out
    assert "(loaded 3 messages" in out and "[user] Hello" in out and "[system] Be brief." in out
    assert "unknown command /nope" in out
    import qwenmetal as qm
    s = qm.Session.load(save, qm.Model.load(d, backend="reference"))
    assert [m["role"] for m in s.metadata["messages"]] == ["system", "user", "assistant"]


def test_chat_names_the_missing_file(tmp_path):
    """A checkpoint without tokenizer.json is not 'no chat template': each error names its real cause."""
    import json
    d = _ckpt(tmp_path)
    notok = tmp_path / "notok"
    shutil.copytree(d, notok)
    (notok / "tokenizer.json").unlink()
    r = run(["chat", "--model", str(notok), "--backend", "reference"], tmp_path, stdin="hi\n")
    assert r.returncode == 2 and "no tokenizer.json" in r.stderr and "chat template" not in r.stderr, r.stderr
    r = run(["generate", "--model", str(notok), "--backend", "reference", "--chat", "--prompt", "hi"], tmp_path)
    assert r.returncode == 2 and "no tokenizer.json" in r.stderr, r.stderr
    notpl = tmp_path / "notpl"
    shutil.copytree(d, notpl)
    for f in notpl.glob("chat_template.jinja"):
        f.unlink()
    cfg = json.loads((notpl / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (notpl / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = run(["chat", "--model", str(notpl), "--backend", "reference"], tmp_path, stdin="hi\n")
    assert r.returncode == 2 and "no chat template (no chat_template.jinja" in r.stderr, r.stderr


def test_refused_conversation_and_bad_generation_config_are_one_line_errors(tmp_path):
    """A conversation the chat template refuses, and a generation_config.json value qwenmetal cannot use,
    are reported in one line naming the cause (not a traceback, not a failure later on a worker thread)."""
    import json
    d = _ckpt(tmp_path)
    tpl = tmp_path / "tpl"
    shutil.copytree(d, tpl)
    (tpl / "chat_template.jinja").write_text("{{ raise_exception('only pirates may talk here') }}")
    r = run(["generate", "--model", str(tpl), "--backend", "reference", "--chat", "--prompt", "hi"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "chat template cannot render this conversation: only pirates may talk here" in r.stderr, r.stderr
    gc = tmp_path / "gc"
    shutil.copytree(d, gc)
    (gc / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    r = run(["generate", "--model", str(gc), "--backend", "reference", "--prompt", "hi"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "generation_config.json: temperature" in r.stderr, r.stderr


def test_backend_help_lists_every_backend(tmp_path):
    from qwenmetal.backends import ALL_BACKENDS, BACKENDS
    r = run(["generate", "--help"], tmp_path)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert all(b in text for b in ALL_BACKENDS) and "available here:" in text
    assert set(BACKENDS) <= set(ALL_BACKENDS) and {"reference", "cpu", "metal", "metal-sim"} <= set(ALL_BACKENDS)


def test_python_dash_m_and_version(tmp_path):
    """`python -m qwenmetal` is the `qwenmetal` command; `--version` prints the package's version (the
    installed distribution's, where there is one)."""
    from importlib import metadata

    import qwenmetal
    want = qwenmetal.__version__
    try:
        assert metadata.version("qwenmetal") == want
    except metadata.PackageNotFoundError:          # a source tree on PYTHONPATH
        pass
    assert qwenmetal.__version__ == want
    env = dict(os.environ, QWENMETAL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "qwenmetal", "--version"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout == f"qwenmetal {want}\n", (r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "qwenmetal", "info", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: qwenmetal info"), r.stderr
    r = run(["--version"], tmp_path)
    assert r.returncode == 0 and r.stdout == f"qwenmetal {want}\n"


def test_bad_arguments_name_the_option_and_what_it_takes(tmp_path):
    """--seed -1 and --cache-bytes -1 are refused by the argument parser, naming the option and what it
    takes; an empty prompt says so (as the server does), before any model loads."""
    d = _ckpt(tmp_path)
    gen = ["generate", "--model", str(d), "--backend", "reference", "--max-tokens", "2"]
    r = run(gen + ["--prompt", "x", "--seed", "-1"], tmp_path)
    assert r.returncode == 2 and "argument --seed: must be an integer >= 0" in r.stderr, r.stderr
    for cmd in ("demo", "bench", "compare"):        # bench's and compare's seed: their random checkpoint's
        r = run([cmd, "--seed", "-1"], tmp_path)
        assert r.returncode == 2 and "argument --seed: must be an integer >= 0" in r.stderr, (cmd, r.stderr)
    r = run(gen + ["--prompt", "x", "--seed", "abc"], tmp_path)
    assert r.returncode == 2 and "argument --seed: expected an integer >= 0" in r.stderr, r.stderr
    for opt in ("--cache-bytes", "--cache-dir-bytes"):
        cmd = gen + ["--prompt", "x"] if opt == "--cache-bytes" else ["serve", "--model", str(d)]
        r = run(cmd + [opt, "-1"], tmp_path)
        assert r.returncode == 2 and f"argument {opt}: must be a number of bytes >= 0" in r.stderr, r.stderr
    for args, stdin in ((["--prompt", ""], None), ([], "")):
        r = run(gen + args, tmp_path, stdin=stdin)
        assert r.returncode == 2 and "qwenmetal: error: the prompt is empty" in r.stderr, r.stderr
        assert "token_ids" not in r.stderr
    r = run(["demo", "--prompt", ""], tmp_path)
    assert r.returncode == 2 and "qwenmetal: error: the prompt is empty" in r.stderr, r.stderr
    assert not (tmp_path / "cache").exists()               # refused before the demo wrote its checkpoint
    # a valid seed and budget still run
    r = run(gen + ["--prompt", "x", "--seed", "0", "--cache-bytes", "0", "--quiet"], tmp_path)
    assert r.returncode == 0, r.stderr


def _chat_on_a_terminal(tmp_path, d, key):
    """`qwenmetal chat` on a pseudo-terminal (stdin, stdout and stderr, where input() writes the prompt):
    wait for the '> ' prompt, then `key` ("ctrl-c": SIGINT, as the terminal sends it; "ctrl-d": the EOF
    character); -> (exit code, what the terminal showed after the prompt)."""
    import pty
    import select
    import signal

    exe = shutil.which("qwenmetal")
    cmd = [exe] if exe else [sys.executable, "-m", "qwenmetal.cli"]
    env = dict(os.environ, QWENMETAL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd + ["chat", "--model", str(d), "--backend", "reference"], stdin=slave, stdout=slave,
                         stderr=slave, env=env)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + 120

    def read_some():
        nonlocal shown
        if select.select([master], [], [], 0.1)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:                   # EIO: the child closed the terminal
                chunk = b""
            shown += chunk
            return bool(chunk)
        return p.poll() is None

    try:
        while not shown.endswith(b"> "):
            assert read_some() and time.monotonic() < deadline, (shown, p.poll())
        at = len(shown)
        # the prompt is written just before input() blocks in read(): a SIGINT in between would only be
        # seen after the next line, so wait until the main thread sleeps (a person is never that quick)
        stat = f"/proc/{p.pid}/stat"
        while os.path.exists(stat) and open(stat).read().rsplit(")", 1)[1].split()[0] != "S":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        if key == "ctrl-c":
            p.send_signal(signal.SIGINT)
        else:
            os.write(master, b"\x04")
        rc = p.wait(60)
        while read_some() and p.poll() is None:
            pass
        while select.select([master], [], [], 0.2)[0] and read_some():
            pass
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    return rc, shown[at:].decode()


def test_chat_leaves_the_prompt_line_on_ctrl_c_and_ctrl_d(tmp_path):
    """Ctrl-C at an idle prompt is an interrupt like in every command (a new line, 'interrupted', 130);
    Ctrl-D ends the chat with 0 and does not leave the shell's prompt on the '> ' line."""
    d = _ckpt(tmp_path)
    rc, shown = _chat_on_a_terminal(tmp_path, d, "ctrl-c")
    assert rc == 130 and shown.startswith("\r\n") and "qwenmetal: interrupted" in shown, (rc, shown)
    assert "Traceback" not in shown
    rc, shown = _chat_on_a_terminal(tmp_path, d, "ctrl-d")
    assert rc == 0 and shown == "\r\n", (rc, shown)


def test_simulator_speeds_say_they_are_the_simulators(tmp_path):
    """metal-sim's tok/s are the simulator's, not a GPU's: the demo's speed line and the statistics line of
    generate / chat say so; other backends' lines do not carry the note."""
    from qwenmetal.backends import BACKENDS
    from qwenmetal.cli import _stats_line
    st = {"prefill_tokens_per_second": 20.0, "prefill_tokens": 5, "decode_tokens_per_second": 12.2,
          "prompt_tokens": 5, "cached_tokens": 0, "generated_tokens": 3, "finish_reason": "length"}
    note = "(metal-sim: the Metal graph on a CPU simulator, not GPU speed)"
    assert f"12.2 tok/s decode {note}; finish" in _stats_line(st, "metal-sim")
    assert "simulator" not in _stats_line(st, "cpu") and "simulator" not in _stats_line(st)
    if "metal-sim" not in BACKENDS:
        return
    r = run(["demo", "--backend", "metal-sim", "--max-tokens", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"[\d.]+ tok/s decode " + re.escape(note), r.stdout), r.stdout


def test_install_hints_fit_how_qwenmetal_was_installed(monkeypatch, capsys, tmp_path):
    """An extra's install hint: 'qwenmetal[x]' from an index; '".[x]"' in the source tree for a copy run or
    installed from one (an index's qwenmetal could be another version); both where it cannot tell. The
    serve command and compare's skipped plots use it."""
    import importlib.util

    from qwenmetal import install_hints
    from qwenmetal.install_hints import install_hint
    # this checkout: PYTHONPATH / an editable install (the source tree), or `pip install .` (direct_url.json)
    assert install_hint("server").startswith('pip install ".[server]" in the source tree ')
    monkeypatch.setattr(install_hints, "_source_tree", lambda: None)
    monkeypatch.setattr(install_hints, "_direct_url", lambda: None)
    assert install_hint("server") == "pip install 'qwenmetal[server]'"
    monkeypatch.setattr(install_hints, "_direct_url", lambda: {"url": "file:///src/my%20qm", "dir_info": {}})
    assert install_hint("plots") == 'pip install ".[plots]" in the source tree /src/my qm'
    monkeypatch.setattr(install_hints, "_direct_url", lambda: {"url": "https://example.org/qm.tar.gz",
                                                               "archive_info": {}})
    assert install_hint("server") == ("pip install 'qwenmetal[server]', or pip install \".[server]\" in "
                                      "qwenmetal's source tree")
    # where the hints are given
    monkeypatch.setattr(install_hints, "_direct_url", lambda: {"url": "file:///src/qm", "dir_info": {}})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "uvicorn" else real(n, *a))
    from qwenmetal import cli
    assert cli.main(["serve", "--model", str(tmp_path)]) == 2
    assert 'missing uvicorn): pip install ".[server]" in the source tree /src/qm' in capsys.readouterr().err
    from qwenmetal.compare import report
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib: ImportError
    rec = {}
    monkeypatch.setattr(report, "format_markdown", lambda r: "")
    report.write_outputs(rec, tmp_path, log=lambda s: None)
    assert rec["plots"] == {"skipped": 'matplotlib is not installed (pip install ".[plots]" in the source tree '
                                       '/src/qm)'}
