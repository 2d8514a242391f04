"""Files written and read: Session.save and convert write atomically (a full disk, a permission error or a
missing directory give an OSError naming the user's path and leave nothing behind, an existing file
untouched); the model identity changes with any byte of the weights (full hash, cached by path, inode,
size, mtime and ctime); a weight file that changes after loading is detected before a session names the
model."""
import errno
import os
import shutil
import time

import pytest

import qwenmetal as qm
from qwenmetal import fileio, session_io
from qwenmetal.convert import convert
from qwenmetal.errors import CheckpointError
from qwenmetal.safetensors_io import SafetensorsWriter
from qwenmetal.testing import cached_checkpoint


@pytest.fixture()
def ck(tmp_path, monkeypatch):
    """A private copy of the tiny checkpoint and a private hash cache."""
    src = cached_checkpoint("tiny", "mlx-q4")
    monkeypatch.setenv("QWENMETAL_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    return d


def session_of(model):
    s = model.new_session()
    model.prefill(s, [5, 9, 2, 77])
    return s


def leftovers(d):
    return sorted(p.name for p in d.iterdir() if ".partial" in p.name)


def failing_write(err):
    """A SafetensorsWriter.write that writes the first tensor, then fails like a full disk."""
    real = SafetensorsWriter.write
    calls = []

    def write(self, name, a):
        if calls:
            raise OSError(err, os.strerror(err))
        calls.append(name)
        real(self, name, a)
    return write


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES, errno.EIO])
def test_session_save_failure_leaves_the_old_file(ck, tmp_path, monkeypatch, err):
    model = qm.Model.load(ck, backend="reference")
    out = tmp_path / "out"
    out.mkdir()
    p = out / "s.safetensors"
    p.write_bytes(b"previous contents")
    monkeypatch.setattr(SafetensorsWriter, "write", failing_write(err))
    with pytest.raises(OSError, match=f"cannot write {p}: {os.strerror(err)}") as e:
        session_of(model).save(p)
    assert e.value.errno == err and ".partial" not in str(e.value)
    assert p.read_bytes() == b"previous contents" and leftovers(out) == []


def test_session_save_unwritable_or_missing_directory(ck, tmp_path, monkeypatch):
    model = qm.Model.load(ck, backend="reference")
    s = session_of(model)
    missing = tmp_path / "nope" / "s.safetensors"
    with pytest.raises(FileNotFoundError, match=f"cannot write {missing}: the directory .*nope does not exist"):
        s.save(missing)
    assert not missing.parent.exists()

    def denied(*a, **k):            # we may run as root, where chmod does not deny: simulate it
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".s.safetensors.x.partial"))
    monkeypatch.setattr(fileio.tempfile, "mkstemp", denied)
    with pytest.raises(PermissionError, match=f"cannot write {tmp_path / 's.safetensors'}: Permission denied$"):
        s.save(tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()


def test_session_save_success_replaces_atomically(ck, tmp_path):
    model = qm.Model.load(ck, backend="reference")
    p = tmp_path / "s.safetensors"
    p.write_bytes(b"old")
    session_of(model).save(p)
    assert qm.Session.load(p, model).tokens == (5, 9, 2, 77) and leftovers(tmp_path) == []
    assert oct(p.stat().st_mode & 0o777) == "0o644"


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES])
def test_convert_failure_leaves_nothing(tmp_path, monkeypatch, err):
    src = cached_checkpoint("tiny", "hf-bf16")
    dst = tmp_path / "out" / "mlx"
    monkeypatch.setattr(SafetensorsWriter, "write", failing_write(err))
    with pytest.raises(OSError, match=f"cannot write {dst}: {os.strerror(err)}") as e:
        convert(src, dst)
    assert e.value.errno == err and not dst.exists() and leftovers(dst.parent) == []
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    with pytest.raises(FileExistsError, match=f"{full} exists and is not an empty directory"):
        convert(src, full)
    assert [p.name for p in full.iterdir()] == ["keep"]


# ---- identity ---------------------------------------------------------------------------------------------
def poke_middle(f):
    """Change one byte in the middle of `f`, keeping its size and mtime."""
    st = f.stat()
    with open(f, "r+b") as h:
        h.seek(st.st_size // 2)
        b = h.read(1)
        h.seek(st.st_size // 2)
        h.write(bytes([b[0] ^ 0xFF]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns


def test_identity_changes_with_any_byte_even_with_mtime_restored(ck, monkeypatch):
    monkeypatch.setattr(session_io, "RACY_SECONDS", 0.0)     # the fixture is seconds old: let it be cached
    hashed = []
    real = session_io._hash_file
    monkeypatch.setattr(session_io, "_hash_file", lambda p: hashed.append(p) or real(p))
    a = qm.Model.load(ck, backend="reference").identity
    assert len(hashed) == 1
    assert qm.Model.load(ck, backend="reference").identity == a and len(hashed) == 1   # from the cache
    time.sleep(0.05)                      # past the timestamp tick of the hash
    poke_middle(ck / "model.safetensors")
    b = qm.Model.load(ck, backend="reference").identity
    assert len(hashed) == 2 and b["identity"] != a["identity"] and b["config_sha256"] == a["config_sha256"]


def test_recent_files_are_not_cached(ck, monkeypatch):
    """A file written within RACY_SECONDS of its hash could be written again in the same timestamp tick."""
    hashed = []
    real = session_io._hash_file
    monkeypatch.setattr(session_io, "_hash_file", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(session_io, "RACY_SECONDS", 3600.0)
    session_io.file_sha256(str(ck / "model.safetensors"))
    session_io.file_sha256(str(ck / "model.safetensors"))
    assert len(hashed) == 2


def test_corrupt_cache_entry_is_ignored_and_rewritten(ck, monkeypatch):
    monkeypatch.setattr(session_io, "RACY_SECONDS", 0.0)
    f = str(ck / "model.safetensors")
    good = session_io.file_sha256(f)
    (entry,) = (ck.parent / "cache" / "hashes").iterdir()
    for junk in (b"", b"\xff\xfe", b'{"key": "other", "sha256": "0"}', b"[1, 2]", b'{"sha256": 5}'):
        entry.write_bytes(junk)
        assert session_io.file_sha256(f) == good
        assert entry.read_bytes() != junk and session_io.file_sha256(f) == good


def test_changed_weight_file_is_detected(ck, tmp_path):
    model = qm.Model.load(ck, backend="reference")
    s = session_of(model)
    f = ck / "model.safetensors"
    with open(f, "ab") as h:              # grows: the mapped part is still readable
        h.write(b"\0" * 8)
    p = tmp_path / "s.safetensors"
    with pytest.raises(CheckpointError, match=r"model\.safetensors: weight file changed since the model was "
                                              r"loaded \(size \d+ -> \d+ bytes\)"):
        s.save(p)
    assert not p.exists() and leftovers(tmp_path) == []
    with open(f, "r+b") as h:
        h.truncate(f.stat().st_size - 8)
    with pytest.raises(CheckpointError, match=r"changed since the model was loaded \(modified\)"):
        model.identity
    shutil.copyfile(f, tmp_path / "copy")
    os.replace(tmp_path / "copy", f)      # another inode under the name
    with pytest.raises(CheckpointError, match=r"changed since the model was loaded \(replaced by another file\)"):
        model.identity
