"""Hub ids resolve through huggingface_hub: here from a populated local hub cache, offline."""
import os
import shutil

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.errors import CheckpointError
from qwenmetal.testing import make_checkpoint


def test_hub_id_from_local_cache(tmp_path, monkeypatch):
    src = make_checkpoint(tmp_path / "src", config="tiny", format="mlx-q4")
    cache = tmp_path / "hub"
    repo = cache / "models--someorg--tiny-qwen"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    m = qm.Model.load("someorg/tiny-qwen", backend="reference")
    assert os.path.realpath(m.path) == os.path.realpath(snap)
    ref = qm.Model.load(src, backend="reference")
    np.testing.assert_array_equal(m.prefill(m.new_session(), [1, 2, 3]), ref.prefill(ref.new_session(), [1, 2, 3]))
    with pytest.raises(CheckpointError, match="could not get 'someorg/absent'"):
        qm.Model.load("someorg/absent", backend="reference")
