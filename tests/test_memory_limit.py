"""Models larger than memory, under a real memory limit (docs/verification.md): a checkpoint about
twice the size of a memory cgroup's limit generates, inside that cgroup, the same greedy tokens as the
resident run outside it; the cgroup's peak (RSS + page cache + kernel memory charged to it) stays inside
the limit, and the expert stats show that the routed experts were streamed. The cgroup comes from
:mod:`qwenmetal.memlimit` (v1 or v2, as root); the tests are skipped only where the OS gives no way to
limit memory, and fail instead when CI=true.

The checkpoint: the tiny preset widened so that the routed experts dominate (hidden 256, 8 layers, 64
experts x 256) and stored as bf16, about 205 MB, written in about 2 s (a 4-bit checkpoint of that size
would take far longer to quantize; the bit widths are covered by the kernel tests, the limit is what is
tested here). A Python child with qwenmetal imported charges 32 MiB to its cgroup by itself (more when
the page cache no longer holds the shared libraries it maps), and the streamed run needs about 22 MiB
more, so the ~98 MiB limit leaves some 40 MiB of headroom for that difference between machines.
"""
import copy
import json
import os

import pytest

from oracles import unavailable
from qwenmetal import memlimit
from qwenmetal.bench.checkpoint import layer_types
from qwenmetal.testing import PRESETS, cached_checkpoint

FORMAT = "mlx-bf16"
LAYERS = 8
PROMPT = [11, 97, 230, 5, 301, 42, 7, 180]
NEW_TOKENS = 12
SLOTS = 4                       # expert slots per layer (top-2 routing: two tokens' experts)


def _config() -> dict:
    cfg = copy.deepcopy(PRESETS["tiny"])
    cfg.pop("vision_config")
    cfg["text_config"].update(hidden_size=256, num_experts=64, moe_intermediate_size=256,
                              num_hidden_layers=LAYERS, layer_types=layer_types(LAYERS))
    return cfg


def _require_cgroup():
    why = memlimit.unavailable_reason()
    if why is not None:
        unavailable(f"no way to limit memory here: {why}")


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


# the child: load with streaming forced (explicit budget, SLOTS slots per layer, LRU), generate greedily,
# report the tokens, the expert stats and what memory_budget="auto" resolves to inside the cgroup
_CHILD = """
import json, sys
import qwenmetal as qm
from qwenmetal import expert_streaming as streaming
from qwenmetal import memlimit, memory
path, budget, slots, prompt, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
auto = memory.available_memory()
m = qm.Model.load(path, backend="cpu", threads=2, memory_budget=budget, expert_slots=slots, expert_policy="lru")
outs = list(m.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True))
memlimit.report({"tokens": [o.token for o in outs], "experts": outs[-1].stats["experts"], "auto_budget": auto})
"""


def test_checkpoint_twice_the_limit_generates_the_resident_tokens():
    _require_cgroup()
    import qwenmetal as qm

    path = cached_checkpoint(_config(), FORMAT, 0)
    size = _dir_bytes(path)
    limit = size // 2
    # first the limited child, with the checkpoint evicted from the page cache so that every page it
    # reads is charged to its cgroup; the resident run (whose mapping would pin the pages) comes after
    run = memlimit.run_python(_CHILD, limit, args=[str(path), str(limit), str(SLOTS), json.dumps(PROMPT),
                                                   str(NEW_TOKENS)], timeout=120, drop_cache=[path])
    run.check()
    resident = qm.Model.load(str(path), backend="cpu", threads=2, memory_budget=None)
    want = [o.token for o in resident.generate(PROMPT, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)]

    got, experts = run.result["tokens"], run.result["experts"]
    assert got == want, f"streamed under a {limit / 2**20:.1f} MiB limit: {got}; resident: {want}"
    assert run.oom_kills == 0
    assert run.peak_bytes <= limit, f"cgroup peak {run.peak_bytes} > limit {limit}"
    assert experts["streaming"] is True and experts["slots_per_layer"] == SLOTS, experts
    assert experts["bytes_read"] > 0 and experts["hit_rate"] < 1.0, experts
    # the pressure was real: the child filled its limit (with page cache the kernel then had to reclaim)
    assert run.peak_bytes > 0.9 * limit, f"the child never came near its {limit} byte limit (peak {run.peak_bytes})"
    # memory_budget="auto" sees the cgroup's limit
    assert 0 < run.result["auto_budget"] <= limit, run.result["auto_budget"]


def test_the_limit_is_enforced():
    """The control: a child that touches twice its limit in anonymous memory (which cannot be reclaimed
    without swap) is killed by the OOM killer, so a limited run that succeeds did stay inside the limit."""
    _require_cgroup()
    limit = 64 << 20
    run = memlimit.run_python("b = bytearray(128 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
                              "from qwenmetal import memlimit\nmemlimit.report('survived')", limit, timeout=60)
    assert run.result is None and run.returncode == -9 and run.oom_kills >= 1, run
    assert run.peak_bytes <= limit
    with pytest.raises(RuntimeError, match="killed by signal 9"):
        run.check()


def test_bad_limit_is_refused():
    with pytest.raises(ValueError, match="limit_bytes must be a positive int"):
        memlimit.run_python("pass", 0)


def test_report_outside_a_child_is_refused(monkeypatch):
    monkeypatch.delenv(memlimit.RESULT_ENV, raising=False)
    with pytest.raises(RuntimeError, match="outside a memlimit child"):
        memlimit.report(1)
