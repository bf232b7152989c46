"""A small, fast reader of a GGUF file's header: metadata key/values and tensor infos.

``gguf.GGUFReader`` builds one numpy view per array element, so opening a file
with a 262K-token vocabulary takes ~20 s; this reader walks the header once
with ``struct`` over the first megabytes of the file (string arrays in a plain loop, numeric
arrays with one ``np.frombuffer``) and never touches the tensor data.

    header = read_gguf_header(path)          # GGUFHeader
    header.metadata["tokenizer.ggml.tokens"] # python values: str, int, float, bool, list
    info = header.tensors["token_embd.weight"]
    raw = tensor_bytes(path, info)           # read-only uint8 memmap of its n_bytes

Layout (GGUF v2/v3, little- or big-endian): magic ``GGUF``, version u32,
tensor count u64, key/value count u64, the key/values, the tensor infos
(name, n_dims u32, dims u64 innermost first, ggml type u32, offset u64
relative to the data section), then the data section at the next multiple of
``general.alignment`` (32 by default). Every read is bounds-checked: a
truncated or corrupt file raises ``CheckpointError`` naming the file, what
was being read and where.
"""
from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np

from models.errors import CheckpointError

__all__ = ["GGUFHeader", "GGUFTensorInfo", "read_gguf_header", "read_gguf_metadata",
           "tensor_bytes"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct code, numpy dtype code); STRING and ARRAY are handled apart.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"),
    5: ("i", "i4"), 6: ("f", "f4"), 7: ("?", "u1"), 10: ("Q", "u8"), 11: ("q", "i8"),
    12: ("d", "f8"),
}
_BOOL = 7
_MAX_DIMS = 8
_FIRST_READ = 16 << 20  # bytes read first; a longer header is read again with 4x more


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the header.

    dims: ggml order (innermost / fastest-varying first), as stored;
    ``shape`` is the numpy (row-major) order. offset: absolute byte offset of
    the data in the file. n_bytes: size of the stored (possibly quantized) data.
    """

    name: str
    ggml_type: int
    type_name: str
    dims: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Numpy order: ``tuple(reversed(dims))``."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    """A parsed header: metadata (key -> python value) and tensor infos (name -> info)."""

    path: str
    version: int
    byte_order: str  # "<" or ">"
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _NeedMore(Exception):
    """The header runs past the bytes read so far (but not past the end of the file)."""


class _Cursor:
    """Bounds-checked sequential reads over the file's first ``len(buf)`` bytes.

    Errors name the file and the item; a read past ``buf`` that is still inside
    the file raises ``_NeedMore`` so the caller can read a longer prefix.
    """

    def __init__(self, buf: bytes, path: str, order: str, file_size: int) -> None:
        self.buf, self.path, self.order, self.pos = buf, path, order, 0
        self.size, self.file_size = len(buf), file_size

    def fail(self, what: str, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt GGUF header while reading {what} "
                               f"at byte {self.pos}: {detail}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            if self.pos + n <= self.file_size:
                raise _NeedMore()
            raise CheckpointError(
                f"{self.path}: GGUF file is truncated or corrupt: {what} needs {n} bytes at byte "
                f"{self.pos}, the file has {self.file_size}")

    def scalar(self, code: str, what: str) -> Any:
        n = struct.calcsize(code)
        self.need(n, what)
        (v,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"the length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(what, f"not UTF-8 ({e.reason} at byte {e.start} of {raw[:40]!r})")
        self.pos += n
        return s

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` length-prefixed strings (the hot loop: vocabularies of 10^5 entries)."""
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct(self.order + "Q").unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"the length of {what}[{i}]")
            (n,) = unpack(buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                self.pos = pos
                self.need(n, f"{what}[{i}]")
            try:
                append(str(buf[pos:end], "utf-8"))
            except UnicodeDecodeError as e:
                self.pos = pos
                raise self.fail(f"{what}[{i}]", f"not UTF-8 ({e.reason})")
            pos = end
        self.pos = pos
        return out

    def array(self, dtype: str, count: int, what: str) -> np.ndarray:
        dt = np.dtype(dtype).newbyteorder(self.order)
        n = count * dt.itemsize
        self.need(n, what)
        arr = np.frombuffer(self.buf, dt, count, self.pos)
        self.pos += n
        return arr


def _value(cur: _Cursor, vtype: int, key: str) -> Any:
    """One metadata value of type ``vtype`` as a python value (arrays as lists)."""
    if vtype == _STRING:
        return cur.string(f"the value of {key!r}")
    if vtype in _SCALARS:
        v = cur.scalar(_SCALARS[vtype][0], f"the value of {key!r}")
        return bool(v) if vtype == _BOOL else v
    if vtype != _ARRAY:
        raise cur.fail(f"the type of {key!r}", f"unknown GGUF value type {vtype}")
    etype = cur.scalar("I", f"the element type of {key!r}")
    count = cur.scalar("Q", f"the element count of {key!r}")
    if count > cur.file_size - cur.pos:  # every element takes at least one byte
        raise cur.fail(f"the element count of {key!r}", f"{count} elements cannot fit "
                                                         f"in the {cur.file_size - cur.pos} bytes left")
    if etype == _STRING:
        return cur.strings(count, repr(key))
    if etype in _SCALARS:
        arr = cur.array(_SCALARS[etype][1], count, f"the elements of {key!r}")
        return arr.astype(bool).tolist() if etype == _BOOL else arr.tolist()
    if etype == _ARRAY:
        return [_value(cur, _ARRAY, f"{key}[{i}]") for i in range(count)]
    raise cur.fail(f"the element type of {key!r}", f"unknown GGUF value type {etype}")


def _type_sizes(ggml_type: int) -> tuple[str, int, int]:
    """(name, block size, bytes per block) of a ggml tensor type, from the gguf package."""
    import gguf

    try:
        qt = gguf.GGMLQuantizationType(ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[qt]
    except (ValueError, KeyError):
        return f"type{ggml_type}", 0, 0
    return qt.name, block, size


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, int, tuple[int, ...], int]:
    name = cur.string(f"the name of tensor #{index}")
    n_dims = cur.scalar("I", f"the rank of tensor {name!r}")
    if n_dims > _MAX_DIMS:
        raise cur.fail(f"the rank of tensor {name!r}", f"{n_dims} dimensions (max {_MAX_DIMS})")
    dims = tuple(int(d) for d in cur.array("u8", n_dims, f"the shape of tensor {name!r}"))
    ggml_type = cur.scalar("I", f"the type of tensor {name!r}")
    offset = cur.scalar("Q", f"the data offset of tensor {name!r}")
    return name, ggml_type, dims, offset


def _parse(buf: bytes, path: str, size: int) -> GGUFHeader:
    """Parse the header from ``buf``, the first bytes of a file of ``size`` bytes."""
    if len(buf) < 4 or buf[:4] != _MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (the first bytes are "
                              f"{buf[:4]!r}, not {_MAGIC!r}; {size} bytes)")
    if size < 24:
        raise CheckpointError(f"{path}: GGUF file is truncated: {size} bytes, "
                              "the fixed header alone is 24")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0 and version >> 16:  # a big-endian file reads as a huge version
        order, (version,) = ">", struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    cur = _Cursor(buf, path, order, size)
    cur.pos = 8
    n_tensors = cur.scalar("Q", "the tensor count")
    n_kv = cur.scalar("Q", "the metadata count")
    if n_kv > size or n_tensors > size:
        raise cur.fail("the counts", f"{n_tensors} tensors / {n_kv} metadata entries "
                                     f"cannot fit in {size} bytes")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"the key of metadata entry #{i}")
        vtype = cur.scalar("I", f"the type of {key!r}")
        meta[key] = _value(cur, vtype, key)
    alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment={alignment!r} is not a power of two")
    raw = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ggml_type, dims, rel in raw:
        type_name, block, bsize = _type_sizes(ggml_type)
        n_el = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if block == 0:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}")
        if dims and dims[0] % block:
            raise CheckpointError(f"{path}: tensor {name!r} ({type_name}, dims {list(dims)}): "
                                  f"the first dim is not a multiple of the block size {block}")
        n_bytes = n_el // block * bsize
        start = data_offset + rel
        if start + n_bytes > size:
            raise CheckpointError(
                f"{path}: GGUF file is truncated or corrupt: tensor {name!r} needs bytes {start}.."
                f"{start + n_bytes}, the file has {size}")
        if name in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice in the header")
        tensors[name] = GGUFTensorInfo(name, ggml_type, type_name, dims, start, n_bytes)
    return GGUFHeader(path, version, order, alignment, data_offset, meta, tensors)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse the header of the GGUF file at ``path`` (metadata and tensor infos, no data).

    Raises CheckpointError for a missing, truncated or corrupt file (the
    message names the file, the field or tensor, and the byte position).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CheckpointError(f"{path}: empty file, not a GGUF file")
        chunk = _FIRST_READ
        while True:
            f.seek(0)
            buf = f.read(min(chunk, size))
            try:
                return _parse(buf, path, size)
            except _NeedMore:
                chunk *= 4


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata key/values of a GGUF file as python values (str, int, float, bool, list)."""
    return read_gguf_header(path).metadata


def tensor_bytes(path: str | os.PathLike, info: GGUFTensorInfo) -> np.ndarray:
    """The stored bytes of one tensor: a read-only uint8 memmap of ``info.n_bytes``."""
    return np.memmap(os.fspath(path), np.uint8, "r", offset=info.offset, shape=(info.n_bytes,))
