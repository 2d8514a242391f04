"""Fuzzing the file parsers with hypothesis, over mutations of real files.

Targets (each a real file of the ``tiny`` fixture checkpoint, mutated):

* ``safetensors``: ``model.safetensors`` -> ``SafetensorsFile`` (and every tensor read): byte flips,
  truncations, the 8-byte header length set to huge / past-EOF / short values, header JSON entries with
  other dtypes, shapes, data_offsets (overlapping, out of range, negative, non-int), duplicate keys,
  ``__metadata__`` and the header itself of the wrong type;
* ``index``: ``model.safetensors.index.json`` of a sharded checkpoint -> ``TensorSource`` + ``load_weights``:
  weight_map entries pointing to missing, other or weird files, removed or added, wrong JSON types;
* ``config``: ``config.json`` -> ``ModelConfig.from_file`` + ``load_weights``: every schema field deleted,
  or of another type or range (and the raw text byte-mutated);
* ``session``: a ``Session.save`` file -> ``Session.load`` on the C++ ``cpu`` backend (then one decode step
  when it loads): header fields (model identity, position, max_context, metadata, format, version), tensors
  dropped, added, reshaped, cast, token ids out of range, and raw byte mutations.

The contract: every input ends in ValueError (CheckpointError is one) whose message names the file's
directory, or loads. Each target runs in a subprocess (``python tests/test_fuzz.py TARGET N``), so a
crash (a signal) fails the test instead of killing pytest; there, the address space is limited to
what the process uses after setup + `HEADROOM` (an attempt to allocate what a header claims fails as
MemoryError), each example has a `PER_EXAMPLE_S` alarm and the whole run a timeout.

CI runs `CI_EXAMPLES` examples per target (~10 s each); ``QWENMETAL_FUZZ_EXAMPLES=N`` sets N (the long run
in docs/verification.md).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

CI_EXAMPLES = 150
TARGETS = ("safetensors", "index", "config", "session")
HEADROOM = 768 << 20
PER_EXAMPLE_S = 10


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(target):
    import qwenmetal as qm
    n = int(os.environ.get("QWENMETAL_FUZZ_EXAMPLES", CI_EXAMPLES))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               # the qwenmetal this test imported (the installed one in CI, python/ in a dev tree)
               PYTHONPATH=os.pathsep.join([str(Path(qm.__file__).parents[1]), *sys.path]))
    r = subprocess.run([sys.executable, __file__, target, str(n)], env=env, capture_output=True, text=True,
                       timeout=120 + 2 * n)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"fuzz target {target} failed (exit {r.returncode}):\n{out[-6000:]}"
    assert f"{target}: " in out and " examples (" in out, out[-2000:]


# ---------------------------------------------------------------------------------------------------------
# the fuzz driver (runs in the subprocess)

def _strategies():
    from hypothesis import strategies as st

    from qwenmetal.safetensors_io import DTYPES

    special = st.sampled_from([0, 1, -1, 7, 8, 2**31, 2**32, 2**40, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                               10**30])
    scalar = st.one_of(st.none(), st.booleans(), special, st.integers(-2**70, 2**70),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6),
                       st.sampled_from(sorted(DTYPES) + ["bf16", "F8_E4M3", "", "float32", "default"]))
    weird = st.recursive(scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c,
                                                                                      max_size=3), max_leaves=8)
    return st, special, weird


def _obj_text(pairs) -> str:
    """A JSON object from (key, value) pairs, duplicates kept."""
    return "{" + ",".join(json.dumps(k) + ":" + json.dumps(v) for k, v in pairs) + "}"


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _join(header_text: str, data: bytes, length: int | None = None) -> bytes:
    hb = header_text.encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    return (len(hb) if length is None else length).to_bytes(8, "little") + hb + data


def _bytes_mutation(draw, st, special, blob: bytes) -> bytes:
    b = bytearray(blob)
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "length"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] = draw(st.integers(0, 255))
    elif kind == "truncate":
        del b[draw(st.integers(0, len(b) - 1)):]
    elif kind == "insert":
        i = draw(st.integers(0, len(b)))
        b[i:i] = draw(st.binary(min_size=1, max_size=16))
    else:
        n = int.from_bytes(b[:8], "little")
        v = draw(st.one_of(special, st.sampled_from([n - 1, n + 1, len(b), len(b) - 7, len(b) - 8]),
                           st.integers(0, 2**64 - 1)))
        b[:8] = (v % 2**64).to_bytes(8, "little")
    return bytes(b)


def _header_mutation(draw, st, special, weird, blob: bytes) -> bytes:
    """A safetensors file with a mutated JSON header (data bytes kept)."""
    header, data = _split(blob)
    names = [k for k in header if k != "__metadata__"]
    pairs = list(header.items())
    kind = draw(st.sampled_from(["field", "delete-field", "offsets", "shape", "duplicate", "entry", "whole",
                                 "metadata", "length"]))
    name = draw(st.sampled_from(names))
    e = dict(header[name])
    if kind == "field":
        e[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(weird)
    elif kind == "delete-field":
        del e[draw(st.sampled_from(sorted(e)))]
    elif kind == "offsets":
        other = header[draw(st.sampled_from(names))]["data_offsets"]
        b0, e0 = e["data_offsets"]
        e["data_offsets"] = draw(st.sampled_from([
            other, [e0, b0], [b0, e0 + 1], [b0 - 1, e0], [-1, e0 - b0 - 1], [b0, len(data) + 8],
            [len(data), len(data) + e0 - b0], [float(b0), float(e0)], [b0], [b0, e0, e0], [str(b0), e0]]))
    elif kind == "shape":
        s = list(e["shape"])
        e["shape"] = draw(st.one_of(
            st.lists(st.one_of(special, st.integers(-2, 70)), max_size=5),
            st.just(s[::-1]), st.just(s + [1]), st.just(s[:-1]), st.just([x * 2 for x in s])))
    elif kind == "duplicate":
        pairs.insert(draw(st.integers(0, len(pairs))), (name, e))
        return _join(_obj_text(pairs), data)
    elif kind == "entry":
        e = draw(weird)
    elif kind == "whole":
        return _join(json.dumps(draw(weird)), data)
    elif kind == "metadata":
        pairs = [(k, v) for k, v in pairs if k != "__metadata__"] + [("__metadata__", draw(weird))]
        return _join(_obj_text(pairs), data)
    else:
        text = _obj_text(pairs)
        return _join(text, data, draw(st.one_of(special, st.integers(0, len(text) + len(data) + 64))) % 2**64)
    pairs = [(k, (e if k == name else v)) for k, v in pairs]
    return _join(_obj_text(pairs), data)


def _dict_mutation(draw, st, weird, d: dict, keys: list) -> dict:
    """`d` with one of `keys` (paths: tuples) deleted or set to a weird value, or an extra key."""
    d = json.loads(json.dumps(d))
    path = draw(st.sampled_from(keys))
    parent = d
    for k in path[:-1]:
        parent = parent[k] if isinstance(parent, dict) and isinstance(parent.get(k), dict) else {}
    kind = draw(st.sampled_from(["set", "set", "delete"]))
    if kind == "delete":
        parent.pop(path[-1], None)
    else:
        parent[path[-1]] = draw(weird)
    return d


def _paths(d, prefix=()) -> list:
    out = []
    for k, v in d.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out.extend(_paths(v, prefix + (k,)))
    return out


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout(f"one example took more than {PER_EXAMPLE_S} s")


def _expect_clean(fn, where: Path) -> str:
    """Run one example: 'loaded' or 'refused' (a ValueError naming `where`); anything else propagates."""
    signal.setitimer(signal.ITIMER_REAL, PER_EXAMPLE_S)
    try:
        fn()
    except ValueError as e:
        if str(where) not in str(e):
            raise AssertionError(f"error does not name the file ({where}): {e}") from e
        return "refused"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return "loaded"


def _limit_memory() -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, resource.RLIM_INFINITY))


def main(target: str, n: int) -> None:
    from hypothesis import HealthCheck, given, settings

    import numpy as np

    import qwenmetal as qm
    from qwenmetal.config import ModelConfig
    from qwenmetal.convert import convert
    from qwenmetal.safetensors_io import SafetensorsFile, TensorSource
    try:
        from qwenmetal.safetensors_io import SafetensorsWriter
    except ImportError:
        from qwenmetal.convert import SafetensorsWriter
    from qwenmetal.testing import cached_checkpoint
    from qwenmetal.weights import load_weights

    st, special, weird = _strategies()
    work = Path(tempfile.mkdtemp(prefix="qwenmetal-fuzz-"))
    os.environ["QWENMETAL_CACHE"] = str(work / "cache")      # the hash cache of the session target
    ck = cached_checkpoint("tiny", "mlx-q4")
    counts = {"loaded": 0, "refused": 0}
    case = work / "case"

    def fresh_case(src: Path) -> Path:
        """`case` as a copy of the checkpoint directory `src` (weight files hard-linked: not mutated)."""
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir()
        for f in src.iterdir():
            if f.suffix == ".safetensors":
                os.link(f, case / f.name)
            else:
                shutil.copyfile(f, case / f.name)
        return case

    if target == "safetensors":
        blob = (ck / "model.safetensors").read_bytes()
        f = work / "model.safetensors"

        def check():
            sf = SafetensorsFile(f)
            for k in sf.keys():
                np.asarray(sf.get(k)).tobytes()

        def example(data):
            mut = (_bytes_mutation(data.draw, st, special, blob) if data.draw(st.booleans())
                   else _header_mutation(data.draw, st, special, weird, blob))
            f.write_bytes(mut)
            counts[_expect_clean(check, f)] += 1

    elif target == "index":
        sharded = work / "sharded"
        convert(cached_checkpoint("tiny", "hf-bf16"), sharded, q_bits=4, max_shard_bytes=200_000)
        index = json.loads((sharded / "model.safetensors.index.json").read_text())
        shards = sorted({*index["weight_map"].values()})
        tensors = sorted(index["weight_map"])
        config = ModelConfig.from_file(sharded)

        def example(data):
            d = fresh_case(sharded)
            ix = json.loads(json.dumps(index))
            wm = ix["weight_map"]
            for _ in range(data.draw(st.integers(1, 3))):
                kind = data.draw(st.sampled_from(["retarget", "delete", "add", "weird", "whole", "raw"]))
                name = data.draw(st.sampled_from(tensors))
                if kind == "retarget":
                    wm[name] = data.draw(st.sampled_from(shards + ["missing.safetensors", "", ".", "..",
                                                                  "../model.safetensors", "/etc/passwd",
                                                                  "config.json", "tokenizer.json"]))
                elif kind == "delete":
                    wm.pop(name, None)
                elif kind == "add":
                    wm[data.draw(st.text(max_size=12))] = data.draw(st.sampled_from(shards))
                elif kind == "weird":
                    wm[name] = data.draw(weird)
                elif kind == "whole":
                    ix = data.draw(st.one_of(weird, st.builds(lambda w: {"weight_map": w}, weird)))
                    break
            text = json.dumps(ix).encode()
            if data.draw(st.booleans()) and text:
                text = _bytes_mutation(data.draw, st, special, b"\0" * 8 + text)[8:]
            (d / "model.safetensors.index.json").write_bytes(text)
            counts[_expect_clean(lambda: (TensorSource(d), load_weights(d, config)), d)] += 1

    elif target == "config":
        cfg = json.loads((ck / "config.json").read_text())
        keys = _paths(cfg) + [("text_config", k) for k in ModelConfig.__dataclass_fields__] + \
            [(k,) for k in ("model_type", "text_config", "quantization", "quantization_config")]

        def example(data):
            d = fresh_case(ck)
            if data.draw(st.integers(0, 3)) == 0:
                text = _bytes_mutation(data.draw, st, special, b"\0" * 8 + json.dumps(cfg).encode())[8:]
            else:
                mutated = cfg
                for _ in range(data.draw(st.integers(1, 3))):
                    mutated = _dict_mutation(data.draw, st, weird, mutated, keys)
                text = json.dumps(mutated).encode()
            (d / "config.json").write_bytes(text)
            counts[_expect_clean(lambda: load_weights(d, ModelConfig.from_file(d)), d)] += 1

    elif target == "session":
        model = qm.Model.load(ck, backend="cpu", threads=1)
        s = model.new_session(max_context=64)
        model.prefill(s, [5, 9, 2, 77, 31, 8, 100])
        good = work / "good.safetensors"
        s.save(good, metadata={"note": "x"})
        blob = good.read_bytes()
        sf = SafetensorsFile(good)
        arrays = {k: np.array(sf.get(k)) for k in sf.keys()}
        header = json.loads(sf.metadata["qwenmetal.session"])
        del sf
        hkeys = _paths(header)
        sessions = work / "sessions"
        sessions.mkdir()
        f = sessions / "s.safetensors"

        def check():
            t = qm.Session.load(f, model)
            if t.position < t.max_context:
                model.decode_step(t, 3)

        def example(data):
            kind = data.draw(st.sampled_from(["header", "arrays", "bytes", "safetensors"]))
            h, arr = header, dict(arrays)
            if kind == "header":
                h = _dict_mutation(data.draw, st, weird, header, hkeys)
            elif kind == "arrays":
                name = data.draw(st.sampled_from(sorted(arr)))
                how = data.draw(st.sampled_from(["drop", "extra", "reshape", "cast", "tokens", "grow"]))
                a = arr[name]
                if how == "drop":
                    del arr[name]
                elif how == "extra":
                    arr["state.layers.99.key"] = np.zeros((1, 2), np.float32)
                elif how == "reshape":
                    arr[name] = a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1)
                elif how == "cast":
                    arr[name] = a.astype(data.draw(st.sampled_from([np.float16, np.float64, np.int32, np.uint8])))
                elif how == "tokens":
                    arr["tokens"] = arrays["tokens"].copy()
                    arr["tokens"][data.draw(st.integers(0, len(arr["tokens"]) - 1))] = data.draw(
                        st.sampled_from([-1, model.config.vocab_size, 2**62]))
                else:
                    arr[name] = np.concatenate([a, a], axis=min(1, a.ndim - 1)) if a.ndim else a
            if kind in ("header", "arrays"):
                with SafetensorsWriter(f, {k: (v.dtype, v.shape) for k, v in arr.items()},
                                       metadata={"qwenmetal.session": json.dumps(h)}) as out:
                    for k, v in arr.items():
                        out.write(k, v)
            elif kind == "bytes":
                f.write_bytes(_bytes_mutation(data.draw, st, special, blob))
            else:
                f.write_bytes(_header_mutation(data.draw, st, special, weird, blob))
            counts[_expect_clean(check, sessions)] += 1
    else:
        raise SystemExit(f"unknown target {target!r}; targets: {TARGETS}")

    run = given(st.data())(settings(max_examples=n, deadline=None, database=None, derandomize=n == CI_EXAMPLES,
                                    suppress_health_check=list(HealthCheck))(example))
    signal.signal(signal.SIGALRM, _alarm)
    _limit_memory()
    t0 = time.perf_counter()
    try:
        run()
    finally:
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{target}: {sum(counts.values())} examples ({counts['refused']} refused, {counts['loaded']} loaded) "
              f"in {dt:.1f} s, peak RSS {peak:.0f} MiB")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
