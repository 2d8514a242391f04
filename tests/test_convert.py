"""`qwenmetal convert` (HF bf16 -> MLX 4-bit, as mlx_lm.convert -q): byte-identical to the mlx-* fixtures, which
tests/test_fixtures.py checks against mlx_lm.convert itself; the streaming safetensors writer equals
safetensors.numpy.save_file; sharded output loads and computes the same."""
import hashlib
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import qwenmetal as qm
from qwenmetal.convert import SafetensorsWriter, convert
from qwenmetal.testing import make_checkpoint


def digests(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("conv")


def test_cli_convert_is_byte_identical_to_mlx_q4(root):
    hf = make_checkpoint(root / "hf", "tiny", "hf-bf16", seed=0)
    ref = make_checkpoint(root / "mlx-q4", "tiny", "mlx-q4", seed=0)
    out = root / "converted"
    exe = shutil.which("qwenmetal")
    cmd = [exe] if exe and os.environ.get("CI") == "true" else [sys.executable, "-m", "qwenmetal.cli"]
    # --drop-vision: the text-only checkpoint mlx_lm.convert writes (without it the tower is kept, as mlx-vlm's
    # conversion keeps it: tests/test_vision_reference.py)
    r = subprocess.run(cmd + ["convert", "--model", str(hf), "--out", str(out), "--drop-vision", "--quiet"],
                       capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    assert digests(out) == digests(ref)
    # refuses to overwrite, and refuses an already-converted checkpoint
    r = subprocess.run(cmd + ["convert", "--model", str(hf), "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "not an empty directory" in r.stderr
    with pytest.raises(ValueError, match="already quantized"):
        convert(ref, root / "again")


@pytest.mark.parametrize("preset, fmt, bits", [("tiny", "mlx-q8", 8), ("tiny", "mlx-bf16", None),
                                               ("tiny-text", "mlx-q4", 4), ("tiny-qwen3-next", "mlx-q4", 4),
                                               ("tiny-qwen3-next", "mlx-bf16", None), ("tiny", "mlx-q5", 5)])
def test_convert_matches_every_mlx_fixture(root, preset, fmt, bits):
    """The fixtures of a config with a vision_config ("tiny"), written with vision=True, keep the tower as
    convert does by default (mlx-vlm's layout)."""
    hf = make_checkpoint(root / f"hf-{preset}-{fmt}", preset, "hf-bf16", seed=1)
    vision = preset == "tiny"
    ref = make_checkpoint(root / f"{preset}-{fmt}", preset, fmt, seed=1, vision=vision)
    out = convert(hf, root / f"out-{preset}-{fmt}", q_bits=bits)
    assert digests(out) == digests(ref)


def test_cli_convert_expert_bits_is_the_mixed_fixture(root):
    """`convert SRC DST --bits 4 --expert-bits 2|3` writes the mlx-q4-e2 / -e3 fixtures byte for byte (which
    tests/test_fixtures.py checks against mlx_lm.convert with the same quant_predicate); bad combinations are
    refused naming the option."""
    from qwenmetal.cli import main
    hf = make_checkpoint(root / "hf-e", "tiny", "hf-bf16", seed=0)
    for eb in (2, 3):
        assert main(["convert", str(hf), str(root / f"e{eb}"), "--bits", "4", "--expert-bits", str(eb), "--drop-vision",
                     "--quiet"]) == 0
        assert digests(root / f"e{eb}") == digests(make_checkpoint(root / f"ref-e{eb}", "tiny", f"mlx-q4-e{eb}"))
    # --expert-bits equal to --bits is the plain checkpoint (no per-expert overrides)
    assert digests(convert(hf, root / "e4", expert_bits=4, drop_vision=True)) == \
        digests(make_checkpoint(root / "ref4", "tiny", "mlx-q4"))
    with pytest.raises(qm.errors.InputError, match="expert_bits needs a quantized conversion"):
        convert(hf, root / "bad", q_bits=None, expert_bits=2)
    assert main(["convert", str(hf), str(root / "bad"), "--no-quantize", "--expert-bits", "2"]) == 2
    assert main(["convert", str(hf), str(root / "bad"), "--model", str(hf)]) == 2      # SRC and --model
    assert not (root / "bad").exists()


def test_sharded_output_loads_and_agrees(root):
    hf = make_checkpoint(root / "hf-shard", "tiny-qwen3-next", "hf-bf16", seed=2)
    one = convert(hf, root / "one")
    many = convert(hf, root / "many", max_shard_bytes=200_000)
    shards = sorted(f.name for f in many.iterdir() if f.suffix == ".safetensors")
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    a = qm.Model.load(one, backend="reference")
    b = qm.Model.load(many, backend="reference")
    ids = [5, 6, 7, 8, 9]
    np.testing.assert_array_equal(a.prefill(a.new_session(), ids), b.prefill(b.new_session(), ids))


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.uint32, np.int64, np.uint8, np.int32, np.float64, np.bool_]


@settings(max_examples=25, deadline=None)
@given(spec=st.dictionaries(st.text(alphabet="abcxyz._0123456789", min_size=1, max_size=12),
                            st.tuples(st.sampled_from(range(len(DTYPES))),
                                      st.lists(st.integers(0, 5), min_size=0, max_size=3)),
                            min_size=1, max_size=8),
       reverse=st.booleans())
def test_streaming_writer_equals_save_file(tmp_path_factory, spec, reverse):
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("w")
    rng = np.random.default_rng(0)
    t = {k: np.asarray(rng.normal(size=shape) * 10).astype(DTYPES[i]) for k, (i, shape) in spec.items()}
    save_file(t, str(d / "a.safetensors"), metadata={"format": "mlx"})
    with SafetensorsWriter(d / "b.safetensors", {k: (v.dtype, v.shape) for k, v in t.items()},
                           metadata={"format": "mlx"}) as w:
        for k in sorted(t, reverse=reverse):            # any write order
            w.write(k, t[k])
    assert (d / "a.safetensors").read_bytes() == (d / "b.safetensors").read_bytes()
