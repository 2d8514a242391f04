"""Mutation testing with mutmut (tools/mutation.py): the tests must catch changes to the code that decides
what users get.

By default (and in CI) a bounded run: every mutant mutmut makes of ``Sampler._draw``, ``_distribution`` and
``_pick`` (the top-k / top-p / min-p filters, renormalisation and the seeded draw) and ``verify_draft``
(speculative decoding's acceptance rule), checked by tests/test_sampling.py, except those
documented as equivalent in tools/mutation-equivalent.txt (whose entries are still checked against the
mutants of those names). ``QWENMETAL_MUTATION=full`` runs every mutant of every module in
``tools/mutation.py``'s TARGETS instead (docs/verification.md has the measured times). A mutant that
survives and is not documented as equivalent fails the test, with its diff.
"""
import importlib.util
import os
import sys
from pathlib import Path

from oracles import require  # fails in CI, skips elsewhere

ROOT = Path(__file__).resolve().parent.parent
BOUNDED = ["sampling"], ["qwenmetal.sampling.xǁSamplerǁ" + f + "__mutmut_*"
                         for f in ("_draw", "_distribution", "_pick", "verify_draft")]


def _tool():
    spec = importlib.util.spec_from_file_location("mutation", ROOT / "tools" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutation"] = mod                       # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_surviving_mutants_are_documented_equivalents(tmp_path):
    require("mutmut")
    mutation = _tool()
    full = os.environ.get("QWENMETAL_MUTATION") == "full"
    modules, names = (list(mutation.TARGETS), None) if full else BOUNDED
    out = mutation.run(tmp_path / "mutmut", modules, names=names, skip_equivalent=not full)
    total = sum(out.counts.values())
    assert total >= 50, f"mutmut ran only {total} mutants of {modules} {names or ''}: {out.counts}"
    unclear = {k: v for k, v in out.counts.items() if k not in ("killed", "survived")}
    assert not unclear, f"mutants neither killed nor survived (timeouts, no tests, crashes): {unclear}"
    bad = mutation.unexplained(out, mutation.load_equivalent())
    assert not bad, "surviving mutants (add a test that kills them, or document them as equivalent):\n" + \
        "\n".join(out.diffs[n] for n in bad)
