"""Strict, memory-mapped safetensors reading.

Why our own reader: tensors must be used in place from a read-only memory map (no copy at load,
resident memory grows only as pages are touched), BF16 must come out as a numpy dtype
(``ml_dtypes.bfloat16``), and a malformed file must produce one error that names the file and
the tensor. The format is small: an 8-byte little-endian header length, a JSON header mapping
names to ``{dtype, shape, data_offsets}``, then the data. `SafetensorsWriter` writes files
byte-identical to ``safetensors.numpy.save_file``'s, tensor by tensor (streaming, with Python file
writes, so a full disk is an ordinary OSError).

Nothing in a checkpoint is ever executed: the header is parsed as JSON and the data is viewed
as plain arrays.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import stat
from typing import Iterator, Mapping, NamedTuple

import ml_dtypes
import numpy as np

from .errors import CheckpointError
from .fileio import parse_json

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class FileStamp(NamedTuple):
    """What tells a file's versions apart without reading it. ``ctime_ns`` changes on every write and
    cannot be set back (``os.utime`` sets mtime, and moves ctime to now)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def file_stamp(st: os.stat_result) -> FileStamp:
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafetensorsFile:
    """One safetensors file, memory-mapped read-only. Arrays returned are views into the map."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{self.path}: not a regular file")
            size = st.st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: truncated file ({size} bytes; no header)")
            try:
                self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            except OSError as e:
                raise CheckpointError(f"{self.path}: cannot map ({e.strerror})") from None
        finally:
            os.close(fd)
        self.stat = file_stamp(st)
        # Ask for 2 MiB page-cache folios where the kernel can (Linux THP in "madvise" mode, a filesystem
        # with large folios, e.g. ext4 on 6.x): decode streams the whole map every token, and PMD mappings
        # cut its TLB misses (docs/cpu.md, "Weights and memory"). Only a hint: pages already cached keep
        # their size, and other systems have no such advice.
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.size = size
        n = int.from_bytes(self._mmap[:8], "little")
        if n > MAX_HEADER or 8 + n > size:        # checked before anything of that length is read
            raise CheckpointError(f"{self.path}: bad header length {n} for a {size}-byte file (truncated?)")
        header = parse_json(self._mmap[8:8 + n], f"{self.path}: header", CheckpointError)
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        md = header.pop("__metadata__", None)
        if md is None:
            md = {}
        if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
            raise CheckpointError(f"{self.path}: header field '__metadata__' must map names to strings")
        self.metadata = md
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple, int, int]] = {}
        spans = []
        for name, e in header.items():
            where = f"{self.path}: tensor {name!r}"
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
                raise CheckpointError(f"{where}: header entry must have dtype, shape and data_offsets")
            dt = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
            if dt is None:
                raise CheckpointError(f"{where}: unsupported dtype {e['dtype']!r}")
            shape, offs = e["shape"], e["data_offsets"]
            if (not isinstance(shape, list) or not all(_is_count(s) for s in shape)
                    or not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(o) for o in offs)):
                raise CheckpointError(f"{where}: malformed shape {shape!r} or data_offsets {offs!r}")
            begin, end = offs
            nbytes = math.prod(shape) * dt.itemsize       # exact (Python ints), whatever the header claims
            if end < begin or end - begin != nbytes:
                raise CheckpointError(
                    f"{where}: data_offsets {offs} span {end - begin} bytes but "
                    f"{e['dtype']}{shape} needs {nbytes}")
            if end > data_len:
                raise CheckpointError(
                    f"{where}: data ends at byte {end} but the file holds only {data_len} data bytes (truncated?)")
            self._entries[name] = (dt, tuple(shape), begin, end)
            spans.append((begin, end, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{self.path}: tensors {n0!r} and {n1!r} overlap")

    def check_unchanged(self) -> None:
        """Raise CheckpointError if the file on disk is no longer the one mapped at load (replaced, resized,
        or written to: size, mtime, ctime or inode differ). An in-place write is visible through the map;
        a truncation under it makes reads of the lost pages fault (SIGBUS), which Python cannot catch."""
        try:
            now = file_stamp(os.stat(self.path))
        except OSError as e:
            raise CheckpointError(f"{self.path}: weight file changed since the model was loaded "
                                  f"({e.strerror})") from None
        if now != self.stat:
            was, is_ = self.stat, now
            what = (f"size {was.size} -> {is_.size} bytes" if was.size != is_.size else
                    "replaced by another file" if (was.dev, was.ino) != (is_.dev, is_.ino) else "modified")
            raise CheckpointError(f"{self.path}: weight file changed since the model was loaded ({what}); "
                                  f"load the model again")

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype_name(self, name: str) -> str:
        return DTYPE_NAMES[self._entries[name][0]]

    def shape(self, name: str) -> tuple:
        return self._entries[name][1]

    def get(self, name: str) -> np.ndarray:
        """A read-only array viewing the mapped bytes (no copy)."""
        dt, shape, begin, end = self._entries[name]
        buf = memoryview(self._mmap)[self._data_start + begin:self._data_start + end]
        return np.frombuffer(buf, dtype=dt).reshape(shape)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self._entries)} tensors)"


class TensorSource:
    """All tensors of a checkpoint directory: one ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json`` (or, failing both, every ``*.safetensors`` in the folder)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        index = os.path.join(self.directory, "model.safetensors.index.json")
        files: list[str]
        self._where: dict[str, SafetensorsFile] = {}
        if os.path.exists(index):
            try:
                with open(index, "rb") as f:
                    raw = f.read(MAX_HEADER + 1)
            except OSError as e:
                raise CheckpointError(f"{index}: cannot read ({e.strerror})") from None
            if len(raw) > MAX_HEADER:
                raise CheckpointError(f"{index}: larger than {MAX_HEADER} bytes")
            doc = parse_json(raw, index, CheckpointError)
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: field 'weight_map' must map tensor names to file names")
            files = sorted(set(weight_map.values()))
        else:
            try:
                files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
            except OSError as e:
                raise CheckpointError(f"{self.directory}: cannot list ({e.strerror})") from None
            weight_map = None
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        self.files = {}
        for fn in files:
            if os.path.basename(fn) != fn or fn in ("", ".", ".."):
                raise CheckpointError(f"{index}: shard name {fn!r} must be a plain file name")
            self.files[fn] = SafetensorsFile(os.path.join(self.directory, fn))
        for fn, sf in self.files.items():
            for k in sf.keys():
                if k in self._where:
                    raise CheckpointError(
                        f"{sf.path}: tensor {k!r} also appears in {self._where[k].path}")
                self._where[k] = sf
        if weight_map is not None:
            for k, fn in weight_map.items():
                if k not in self._where:
                    raise CheckpointError(
                        f"{os.path.join(self.directory, fn)}: tensor {k!r} listed in the index is missing")
                if os.path.basename(self._where[k].path) != fn:
                    raise CheckpointError(
                        f"{index}: tensor {k!r} is listed in {fn} but found in {self._where[k].path}")

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def file_of(self, name: str) -> str:
        return self._where[name].path

    def shape(self, name: str) -> tuple:
        return self._where[name].shape(name)

    def dtype_name(self, name: str) -> str:
        return self._where[name].dtype_name(name)

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)

    def check_unchanged(self) -> None:
        """`SafetensorsFile.check_unchanged` for every file."""
        for sf in self.files.values():
            sf.check_unchanged()

    @property
    def metadata(self) -> dict:
        md = {}
        for sf in self.files.values():
            md.update(sf.metadata)
        return md


# the safetensors writer lays tensors out by dtype (this order) then by name
_ST_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "I8", "U8", "BOOL")


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor, in any order, byte-identical to what
    ``safetensors.numpy.save_file`` writes for the same tensors (layout: by dtype, then name; compact JSON
    header padded with spaces to a multiple of 8)."""

    def __init__(self, path, specs: Mapping[str, tuple], metadata: dict | None = None):
        self.path = os.fspath(path)
        names = {}
        for k, (dt, shape) in specs.items():
            dt = np.dtype(dt)
            if dt not in DTYPE_NAMES:
                raise ValueError(f"{k}: dtype {dt} cannot be written")
            names[k] = (DTYPE_NAMES[dt], dt, tuple(int(d) for d in shape))
        order = sorted(names, key=lambda k: (_ST_ORDER.index(names[k][0]), k))
        header: dict = {}
        if metadata:
            header["__metadata__"] = dict(sorted(metadata.items()))
        self._where = {}
        off = 0
        for k in order:
            st, dt, shape = names[k]
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            header[k] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + n]}
            self._where[k] = (dt, shape, off, n)
            off += n
        hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        hb += b" " * ((8 - len(hb) % 8) % 8)
        self._base = 8 + len(hb)
        self._f = open(self.path, "wb")
        self._f.write(len(hb).to_bytes(8, "little") + hb)
        self._f.truncate(self._base + off)
        self._left = set(self._where)

    def write(self, name: str, a: np.ndarray) -> None:
        dt, shape, off, n = self._where[name]
        a = np.asarray(a)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        if a.dtype != dt or a.shape != shape:
            raise ValueError(f"{name}: got {a.dtype}{a.shape}, announced {dt}{shape}")
        self._f.seek(self._base + off)
        self._f.write(memoryview(a.reshape(-1).view(np.uint8)))
        self._left.discard(name)

    def close(self) -> None:
        if self._f is None:
            return
        self._f.close()
        self._f = None
        if self._left:
            raise RuntimeError(f"{self.path}: tensors never written: {sorted(self._left)[:5]}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None and self._f is not None:
            self._f.close()
            self._f = None
            return False
        self.close()
        return False
