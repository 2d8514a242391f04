"""Strict, memory-mapped safetensors reading.

Why our own reader: tensors must be used in place from a read-only memory map (no copy at load,
resident memory grows only as pages are touched), BF16 must come out as a numpy dtype
(``ml_dtypes.bfloat16``), and a malformed file must produce one error that names the file and
the tensor. The format is small: an 8-byte little-endian header length, a JSON header mapping
names to ``{dtype, shape, data_offsets}``, then the data. Writing uses the ``safetensors``
package (``safetensors.numpy.save_file``).

Nothing in a checkpoint is ever executed: the header is parsed as JSON and the data is viewed
as plain arrays.
"""
from __future__ import annotations

import json
import mmap
import os
from typing import Iterator

import ml_dtypes
import numpy as np

from .errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One safetensors file, memory-mapped read-only. Arrays returned are views into the map."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: truncated file ({size} bytes; no header)")
            self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
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
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{self.path}: bad header length {n} for a {size}-byte file (truncated?)")
        try:
            header = json.loads(bytes(self._mmap[8:8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple, int, int]] = {}
        spans = []
        for name, e in header.items():
            where = f"{self.path}: tensor {name!r}"
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
                raise CheckpointError(f"{where}: header entry must have dtype, shape and data_offsets")
            dt = DTYPES.get(e["dtype"])
            if dt is None:
                raise CheckpointError(f"{where}: unsupported dtype {e['dtype']!r}")
            shape, offs = e["shape"], e["data_offsets"]
            if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
                    or not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) and o >= 0 for o in offs)):
                raise CheckpointError(f"{where}: malformed shape {shape!r} or data_offsets {offs!r}")
            begin, end = offs
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
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
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        self.files = {}
        for fn in files:
            if os.path.basename(fn) != fn:
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

    @property
    def metadata(self) -> dict:
        md = {}
        for sf in self.files.values():
            md.update(sf.metadata)
        return md
