"""The files of ``qwenmetal compare``: compare.json (the record), compare.md (the tables), prefill.png and
decode.png (tokens/s against length, one line per engine, and the ratios to the baseline)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..bench import describe_machine
from ..fileio import atomic_file
from ..install_hints import install_hint

PLOTS = ("prefill.png", "decode.png")


def _length(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _num(x, fmt="{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _row(cells) -> str:
    """One Markdown table row; a "|" inside a cell is escaped, so it stays in its cell."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _table(header, rows) -> list:
    """A Markdown table (GFM): the header row, the separator with one column per header cell, the rows."""
    return [_row(header), "|---" * len(header) + "|"] + [_row(r) for r in rows]


def format_markdown(rec: dict) -> str:
    s, st = rec["summary"], rec["settings"]
    eng, base = s["engines"], s["baseline"]
    out = [f"Machine: {describe_machine(rec['machine'], threads=st['threads'])}.",
           f"Checkpoint: {rec['checkpoint']} ({rec['model_type']}, {rec['layers']} layers)"
           + (f"; GGUF {rec['gguf']}" if rec.get("gguf") else "") + ".",
           f"Batch 1, greedy; {st['steps']} decode steps per point, {st['repeats']} sample(s) per point in each of "
           f"{st['rounds']} round(s), engine order alternating; medians. qwenmetal backend: {st['backend']}.", ""]
    for e, v in eng.items():
        ver = ", ".join(f"{k} {v2}" for k, v2 in (v.get("versions") or {}).items()
                        if k not in ("system_info", "settings", "options", "gguf"))
        fl = [f for f in v["foreign_load"] if f is not None]
        out.append(f"* {e}: {ver}; peak RSS {v['peak_rss_bytes'] / 2**30:.2f} GiB"
                   + (f", peak device memory {v['peak_device_bytes'] / 2**30:.2f} GiB" if v.get("peak_device_bytes") else "")
                   + (f"; other processes used up to {100 * max(fl):.0f} % of the CPUs" if fl else "")
                   + "; drift of the first point by the end of a round: "
                   + ", ".join(_num(None if d is None else 100 * d, "{:+.1f} %") for d in v["drift"])
                   + (" (above 3 %: treat this engine's figures with care)" if v["drifted"] else ""))
    for e, why in rec["skipped"].items():
        out.append(f"* {e}: skipped — {why}")
    if eng:
        names = list(eng)
        others = [e for e in names if e != base]          # the engines with a ratio to the baseline
        for kind, title in (("prefill_tok_s", "Prefill (tokens/s; time to the first token)"),
                            ("decode_tok_s", "Decode (tokens/s at that context)")):
            out += ["", f"**{title}**" + (f", ratio = engine / {base}" if others else ""), ""]
            out += _table(["length", *names, *(f"{e} / {base}" for e in others)],
                          [[_length(n), *(_num(eng[e][kind][i]) for e in names),
                            *(_num(s["ratios"][e][kind][i], "{:.2f}×") for e in others)]
                           for i, n in enumerate(s["lengths"])])
        out += ["", "Decode token digests (FNV-1a of the greedy tokens; the same digest in every sample and "
                "round marks a stable point; across engines they may differ, MoE routes being sensitive to "
                "rounding):", ""]
        out += _table(["length", *names],
                      [[_length(n), *("–" if eng[e]["digest"][i] is None else
                                      f"{eng[e]['digest'][i]}{'' if eng[e]['digest_stable'][i] else ' (unstable)'}"
                                      for e in names)] for i, n in enumerate(s["lengths"])])
    q = rec.get("quality") or {}
    if q:
        out += ["", f"**Quality**, teacher-forced on {q.get('tokens')} tokens of a fixed text "
                f"({q.get('tokens', 1) - 1} predicted positions):", ""]
        for key, ref in (("vs_mlx_lm", "mlx-lm"), ("vs_reference", "the numpy reference")):
            if key in q:
                out += [f"against {ref}:", ""]
                out += _table(["engine", "top-1 agreement", "perplexity ratio", "max |Δlogit|", "mean |Δlogit|",
                               "KL mean (nats)"],
                              [[e, f"{100 * m['top1_agree']:.2f} %", f"{100 * (m['ppl_ratio'] - 1):+.2f} %",
                                f"{m['max_abs_diff']:.3g}", f"{m['mean_abs_diff']:.3g}", f"{m['kl_mean']:.3g}"]
                               for e, m in q[key].items()])
                out.append("")
            elif key + "_skipped" in q:
                out += [f"against {ref}: skipped — {q[key + '_skipped']}", ""]
        for e, why in (q.get("unavailable") or {}).items():
            out.append(f"{e}: no quality figures — {why}")
    plots = rec.get("plots")
    if isinstance(plots, dict) and plots.get("skipped"):
        out += ["", f"Plots: skipped — {plots['skipped']}"]
    return "\n".join(out).rstrip() + "\n"


def figure(rec: dict, kind: str):
    """The matplotlib figure of ``kind`` ("prefill_tok_s" or "decode_tok_s"): tokens/s against length
    (log-log), one line per engine, and below it each engine's ratio to the baseline, its y axis from 0
    (no ratio panel when there is no other engine to compare). ImportError when matplotlib is missing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = rec["summary"]
    lengths, eng, base = s["lengths"], s["engines"], s["baseline"]
    machine = describe_machine(rec["machine"]).split(", isa")[0]
    title = "Prefill" if kind == "prefill_tok_s" else "Decode"
    ratios = {e: [(n, r) for n, r in zip(lengths, s["ratios"].get(e, {}).get(kind, [])) if r]
              for e in eng if e != base}
    if any(ratios.values()):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, top = plt.subplots(1, 1, figsize=(8, 5))
        bottom = None
    for i, (e, v) in enumerate(eng.items()):
        color = f"C{i}"                                          # one colour per engine in both panels
        pts = [(n, y) for n, y in zip(lengths, v[kind]) if y]
        if pts:
            top.plot(*zip(*pts), marker="o", color=color, label=e)
        if bottom is not None and ratios.get(e):
            bottom.plot(*zip(*ratios[e]), marker="o", color=color, label=f"{e} / {base}")
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
    top.yaxis.set_major_formatter(plain)
    top.yaxis.set_minor_formatter(plain)
    top.set_ylabel("tokens/s")
    what = "time to the first token" if kind == "prefill_tok_s" else f"{rec['settings']['steps']} steps at that context"
    top.set_title(f"{title} ({what}), batch 1\n{machine}; {rec['model_type']} {rec['layers']} layers", fontsize=9)
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8)
    last = top
    if bottom is not None:
        bottom.axhline(1.0, color="grey", lw=0.8)
        bottom.set_ylabel(f"ratio to {base}")
        bottom.set_ylim(0, 1.1 * max([1.0] + [r for pts in ratios.values() for _, r in pts]))
        bottom.grid(True, which="both", alpha=0.3)
        if len(bottom.lines) > 1:
            bottom.legend(fontsize=8)
        last = bottom
    last.set_xlabel("prompt length (prefill) / context (decode), tokens")
    last.set_xticks(lengths)
    last.set_xticklabels([_length(n) for n in lengths], fontsize=8)
    fig.tight_layout()
    return fig


def plot(rec: dict, out: Path) -> list:
    """prefill.png and decode.png in `out` (`figure`). ImportError when matplotlib is missing."""
    import matplotlib.pyplot as plt
    paths = []
    for kind, name in zip(("prefill_tok_s", "decode_tok_s"), PLOTS):
        fig = figure(rec, kind)
        p = out / name
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))
    return paths


def write_outputs(rec: dict, out: Path, plots: bool = True, log: Callable[[str], None] = print) -> None:
    """compare.json, compare.md and (`plots`) the PNGs in `out`; a run without plots removes the PNGs an
    earlier run left there (only the report's own files, `PLOTS`), so none describes another run."""
    if plots:
        try:
            rec["plots"] = plot(rec, out)
        except ImportError:
            rec["plots"] = {"skipped": f"matplotlib is not installed ({install_hint('plots')})"}
    else:
        rec["plots"] = {"skipped": "--no-plots"}
    if not isinstance(rec["plots"], list):
        for name in PLOTS:
            (out / name).unlink(missing_ok=True)
    for name, text in (("compare.json", json.dumps(rec, indent=1) + "\n"), ("compare.md", format_markdown(rec))):
        with atomic_file(out / name) as tmp:
            tmp.write_text(text, encoding="utf-8")
    log(f"wrote {out / 'compare.json'}, {out / 'compare.md'}"
        + (", " + ", ".join(rec["plots"]) if isinstance(rec["plots"], list) else ""))
