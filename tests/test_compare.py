"""`qwenmetal compare` (docs/benchmarks.md, "qwenmetal compare"): the agreement computation on synthetic
logits with known answers, and a --quick run on the tiny fixture against mlx-lm (CPU) that writes the
record, the table and the plots, reporting the engines it skips."""
import json

import numpy as np
import pytest

from qwenmetal import accuracy, cli


def test_perplexity_of_known_probabilities():
    p = np.array([0.5, 0.25, 0.125, 0.125])
    logits = np.log(np.stack([p, np.roll(p, 1), np.roll(p, 2), p])) + 3.0   # a constant shift changes nothing
    tokens = [9 % 4, 0, 2, 0]            # next tokens 0, 2, 0 under rows 0, 1, 2: p = 0.5, 0.25, 0.125
    assert accuracy.perplexity(logits, tokens) == pytest.approx((0.5 * 0.25 * 0.125) ** (-1 / 3))
    with pytest.raises(ValueError, match="token ids must be in"):
        accuracy.perplexity(logits, [0, 1, 2, 4])
    with pytest.raises(ValueError, match="need logits"):
        accuracy.perplexity(logits[:1], [0])


def test_agreement_against_known_answers():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(200, 50))
    tokens = rng.integers(0, 50, 200).tolist()
    same = accuracy.agreement(base, base.copy(), tokens)
    assert same["top1_agree"] == 1.0 and same["ppl_ratio"] == pytest.approx(1.0) and same["max_abs_diff"] == 0
    assert same["positions"] == 200 and same["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    # the argmax moved at exactly 30 positions: 85 % agreement
    other = base.copy()
    moved = rng.choice(200, 30, replace=False)
    for i in moved:
        j = (int(base[i].argmax()) + 1) % 50
        other[i, j] = base[i].max() + 1.0
    m = accuracy.agreement(base, other, tokens)
    assert m["top1_agree"] == pytest.approx(170 / 200)
    # a model that puts twice the odds on every next token: its perplexity is exactly that of the
    # closed form, and the ratio is their quotient
    sharp = base.copy()
    sharp[np.arange(199), tokens[1:]] += np.log(2.0)
    r = accuracy.agreement(base, sharp, tokens)
    assert r["ppl_ratio"] == pytest.approx(accuracy.perplexity(sharp, tokens) / accuracy.perplexity(base, tokens))
    assert r["ppl_ratio"] < 1 and r["max_abs_diff"] == pytest.approx(np.log(2.0))
    # a longer vocabulary (llama.cpp's padded one) is cut to the common part
    wide = np.concatenate([base, np.full((200, 6), -50.0)], axis=1)
    assert accuracy.agreement(base, wide, tokens)["top1_agree"] == 1.0
    with pytest.raises(ValueError, match="must both be"):
        accuracy.agreement(base, base[:10], tokens)


def rendered_tables(md: str) -> list:
    """The header cells of every table of `md` as markdown-it-py renders it (CommonMark + GFM tables); fails
    if a block of table lines did not become a table (a separator of another width, an unescaped pipe)."""
    from markdown_it import MarkdownIt
    tables = []
    for t in MarkdownIt("commonmark").enable("table").parse(md):
        if t.type == "table_open":
            tables.append([])
            head = True
        elif t.type == "thead_close":
            head = False
        elif t.type == "inline" and tables and head:
            tables[-1].append(t.content)
    blocks = sum(1 for i, line in enumerate(md.splitlines())
                 if line.startswith("|") and (i == 0 or not md.splitlines()[i - 1].startswith("|")))
    assert len(tables) == blocks, f"{blocks} blocks of table lines, {len(tables)} rendered as tables:\n{md}"
    return tables


def test_compare_quick_on_the_tiny_fixture(tmp_path, require):
    require("mlx_lm")                    # an oracle: fails in CI when missing
    require("matplotlib")
    Image = require("PIL.Image")

    out = tmp_path / "cmp"
    # a GGUF path that does not exist: llama.cpp is skipped with its reason, installed or not
    rc = cli.main(["compare", "--quick", "--backend", "cpu", "--threads", "2", "--out", str(out),
                   "--gguf", str(tmp_path / "missing.gguf")])
    assert rc == 0
    rec = json.loads((out / "compare.json").read_text())
    assert rec["schema"] == "qwenmetal-compare/1" and rec["engines"] == ["qwenmetal", "mlx-lm"]
    assert "no such file" in rec["skipped"]["llama.cpp"]
    s = rec["summary"]
    assert s["lengths"] == [16, 64] and s["baseline"] == "mlx-lm"
    for e in ("qwenmetal", "mlx-lm"):
        v = s["engines"][e]
        assert all(x > 0 for x in v["prefill_tok_s"] + v["decode_tok_s"]) and v["peak_rss_bytes"] > 0
        assert len(v["drift"]) == 2 and all(len(d) == 16 for d in v["digest"])
        assert all(r["points"][0]["samples"] for r in (rd[e] for rd in rec["rounds"]))
    # the rounds alternate the engine order and reverse the lengths
    assert [p["length"] for p in rec["rounds"][1]["qwenmetal"]["points"]] == [64, 16]
    assert s["ratios"]["mlx-lm"]["decode_tok_s"] == [1.0, 1.0]
    q = rec["quality"]
    assert q["tokens"] == 256 and q["vs_mlx_lm"]["qwenmetal"]["positions"] == 256
    # the cpu backend against the numpy reference on the same weights: close (random tiny weights have
    # near-ties, so a few argmaxes may differ)
    ref = q["vs_reference"]["qwenmetal"]
    assert ref["top1_agree"] >= 0.9 and abs(ref["ppl_ratio"] - 1) < 0.01 and ref["mean_abs_diff"] < 0.01
    md = (out / "compare.md").read_text()
    assert "| length | qwenmetal | mlx-lm | qwenmetal / mlx-lm |" in md
    require("markdown_it")
    quality = ["engine", "top-1 agreement", "perplexity ratio", "max |Δlogit|", "mean |Δlogit|", "KL mean (nats)"]
    speed = ["length", "qwenmetal", "mlx-lm", "qwenmetal / mlx-lm"]
    assert rendered_tables(md) == [speed, speed, ["length", "qwenmetal", "mlx-lm"], quality, quality]
    assert "llama.cpp: skipped — --gguf" in md and "top-1 agreement" in md
    from qwenmetal.compare.report import figure
    for kind in ("prefill_tok_s", "decode_tok_s"):             # the ratio panel's y axis starts at 0
        fig = figure(rec, kind)
        assert len(fig.axes) == 2 and fig.axes[1].get_ylim()[0] == 0 and fig.axes[1].get_ylim()[1] > 1
    for name in ("prefill.png", "decode.png"):
        with Image.open(out / name) as im:
            im.verify()
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 400


def test_compare_with_one_engine_writes_tables_that_render(tmp_path, require):
    """One engine (the user's first --quick run without mlx-lm): no ratio columns, and every table of
    compare.md renders as a table with its columns (the quality table's |Δlogit| headers escaped); the
    plots have no (empty) ratio panel. Rerun into the same --out with --no-plots, the report's old PNGs
    are removed (they would describe the other run) and nothing else is."""
    require("markdown_it")
    require("matplotlib")
    from qwenmetal.compare.report import PLOTS, figure
    out = tmp_path / "cmp"
    args = ["compare", "--quick", "--backend", "cpu", "--engines", "qwenmetal", "--rounds", "1", "--lengths", "16",
            "--out", str(out)]
    assert cli.main(args + ["--quality-tokens", "193"]) == 0
    md = (out / "compare.md").read_text()
    quality = ["engine", "top-1 agreement", "perplexity ratio", "max |Δlogit|", "mean |Δlogit|", "KL mean (nats)"]
    assert rendered_tables(md) == [["length", "qwenmetal"], ["length", "qwenmetal"], ["length", "qwenmetal"],
                                   quality], md
    assert "ratio = engine" not in md and "| 16 |" in md
    rec = json.loads((out / "compare.json").read_text())
    assert rec["plots"] == [str(out / p) for p in PLOTS] and all((out / p).is_file() for p in PLOTS)
    assert [len(figure(rec, k).axes) for k in ("prefill_tok_s", "decode_tok_s")] == [1, 1]
    (out / "mine.png").write_bytes(b"not the report's")
    assert cli.main(args + ["--quality-tokens", "0", "--no-plots"]) == 0
    assert not any((out / p).exists() for p in PLOTS) and (out / "mine.png").read_bytes() == b"not the report's"
    assert json.loads((out / "compare.json").read_text())["plots"] == {"skipped": "--no-plots"}


def test_compare_reports_an_engine_that_fails_in_one_line(tmp_path, capsys):
    """A failing engine (here: an unknown Model.load option) is reported in one line naming its log."""
    out = tmp_path / "cmp"
    rc = cli.main(["compare", "--quick", "--backend", "cpu", "--engines", "qwenmetal", "--option", "no_such_option=1",
                   "--quality-tokens", "0", "--rounds", "1", "--no-plots", "--out", str(out)])
    assert rc == 0
    rec = json.loads((out / "compare.json").read_text())
    why = rec["skipped"]["qwenmetal"]
    assert why.startswith("qwenmetal failed (") and "no_such_option" in why and "\n" not in why
    err = capsys.readouterr().err
    assert rec["summary"]["engines"] == {} and "Traceback" not in err and '  File "' not in err
    assert (out / "logs" / "round1-qwenmetal.log").exists()


def test_compare_rejects_bad_arguments_before_running(tmp_path, capsys):
    assert cli.main(["compare", "--quick", "--engines", "vllm", "--out", str(tmp_path)]) == 2
    assert "--engines: unknown ['vllm']" in capsys.readouterr().err
    assert cli.main(["compare", "--quick", "--quality-tokens", "50", "--out", str(tmp_path)]) == 2
    assert "--quality-tokens must be 0 or at least 193" in capsys.readouterr().err
    assert not (tmp_path / "compare.json").exists()


def test_an_hf_checkpoint_gets_one_mlx_copy_that_every_engine_runs(tmp_path, monkeypatch):
    from qwenmetal.compare.cli import mlx_copy
    from qwenmetal.config import ModelConfig
    from qwenmetal.testing import cached_checkpoint
    from qwenmetal.weights import checkpoint_layout

    mlx = cached_checkpoint("tiny", "mlx-q4")
    assert mlx_copy(mlx, ModelConfig.from_file(mlx), print) == mlx
    hf = cached_checkpoint("tiny", "hf-bf16")
    monkeypatch.setenv("QWENMETAL_CACHE", str(tmp_path))
    said = []
    copy = mlx_copy(hf, ModelConfig.from_file(hf), said.append)
    assert copy.parent == tmp_path / "compare" and checkpoint_layout(copy, ModelConfig.from_file(copy)) == "mlx"
    assert len(said) == 1 and mlx_copy(hf, ModelConfig.from_file(hf), said.append) == copy and len(said) == 1


def test_compare_runs_llama_cpp_where_it_is_installed(tmp_path):
    """llama.cpp is an optional peer (benchmarks/build_llama_cpp.sh), not a CI oracle: skipped without it."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--quick", "--backend", "cpu", "--engines", "qwenmetal,llama.cpp", "--rounds", "1",
                     "--baseline", "llama.cpp", "--no-plots", "--out", str(out)]) == 0
    rec = json.loads((out / "compare.json").read_text())
    assert rec["engines"] == ["qwenmetal", "llama.cpp"] and not rec["skipped"] and rec["gguf"].endswith(".q4_0.gguf")
    v = rec["summary"]["engines"]["llama.cpp"]
    assert all(x > 0 for x in v["prefill_tok_s"] + v["decode_tok_s"]) and v["digest_stable"] == [True, True]
    assert rec["summary"]["ratios"]["qwenmetal"]["decode_tok_s"][0] > 0
    # a Q4_0 requantization of the same weights: close to the reference, not equal
    m = rec["quality"]["vs_reference"]["llama.cpp"]
    assert 0 < m["mean_abs_diff"] < 1 and abs(m["ppl_ratio"] - 1) < 0.1


def test_llama_bench_points_from_its_json_lines():
    """The llama-bench route (llama.cpp without llama-cpp-python): the two tests of a point and the
    medians of their per-repetition samples, from canned output."""
    import subprocess

    from qwenmetal.compare.engines import llama_bench_point

    calls = []

    def fake(cmd, **kw):
        calls.append(cmd)
        gen = cmd[cmd.index("-n") + 1] != "0"
        row = {"build_commit": "abc", "n_prompt": 0 if gen else 256, "n_gen": 32 if gen else 0,
               "samples_ts": [40.0, 50.0, 45.0] if gen else [200.0, 100.0, 400.0]}
        return subprocess.CompletedProcess(cmd, 0, "main: log line\n" + json.dumps(row) + "\n", "")

    p = llama_bench_point("/x/llama-bench", "m.gguf", 2, 256, 32, 3, 0, run=fake)
    assert calls[0][-4:] == ["-p", "256", "-n", "0"] and calls[1][-6:] == ["-p", "0", "-n", "32", "-d", "256"]
    assert ["-r", "3"] == calls[0][5:7] and "-t" in calls[0] and calls[0][calls[0].index("-ngl") + 1] == "0"
    assert p["prefill_tok_s"] == pytest.approx(200.0) and p["decode_tok_s"] == pytest.approx(45.0)
    assert p["digest"] is None and len(p["samples"]) == 3 and p["llama_bench"]["build_commit"] == "abc"

    def failing(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "error: unknown model architecture\n")
    with pytest.raises(RuntimeError, match="unknown model architecture"):
        llama_bench_point("/x/llama-bench", "m.gguf", 2, 256, 32, 3, 0, run=failing)
