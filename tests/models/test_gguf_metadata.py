"""models/gguf_metadata.py: our header reader against gguf.GGUFReader, and bad files."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from models.errors import CheckpointError
from models.gguf_metadata import read_gguf_header, read_gguf_metadata, tensor_bytes


def _write(path, *, alignment: int | None = None, big_endian: bool = False) -> None:
    """A small GGUF with one value of every type, arrays, and three tensors (one Q8_0)."""
    w = gguf.GGUFWriter(str(path), "llama",
                        endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    V = gguf.GGUFValueType
    w.add_key_value("t.u8", 200, V.UINT8)
    w.add_key_value("t.i8", -100, V.INT8)
    w.add_key_value("t.u16", 60000, V.UINT16)
    w.add_key_value("t.i16", -30000, V.INT16)
    w.add_key_value("t.u32", 4_000_000_000, V.UINT32)
    w.add_key_value("t.i32", -2_000_000_000, V.INT32)
    w.add_key_value("t.u64", 2**63 + 5, V.UINT64)
    w.add_key_value("t.i64", -(2**62), V.INT64)
    w.add_key_value("t.f32", 0.1, V.FLOAT32)
    w.add_key_value("t.f64", 0.1, V.FLOAT64)
    w.add_bool("t.yes", True)
    w.add_bool("t.no", False)
    w.add_string("t.text", "héllo ▁ 日本 🙂")
    w.add_string("t.empty", "")
    w.add_array("t.strings", ["", "a", "▁b", "\n", "<0x0A>", "😀" * 3])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.none", [])
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.bias", np.ones(5, np.float32))
    q = gguf.quants.quantize(np.linspace(-1, 1, 64 * 2, dtype=np.float32).reshape(2, 64),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.gguf"
    _write(path)
    return path


def _reference(path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path), "r")
    meta = {n: f.contents() for n, f in r.fields.items() if not n.startswith("GGUF.")}
    tensors = {t.name: (int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset),
                        int(t.n_bytes), np.asarray(t.data).tobytes()) for t in r.tensors}
    return meta, tensors


@pytest.mark.parametrize("alignment", [None, 64])
def test_matches_gguf_reader(tmp_path, alignment):
    path = tmp_path / "f.gguf"
    _write(path, alignment=alignment)
    ref_meta, ref_tensors = _reference(path)
    h = read_gguf_header(path)
    assert h.metadata == ref_meta
    assert h.metadata["t.text"] == "héllo ▁ 日本 🙂" and h.metadata["t.u64"] == 2**63 + 5
    assert h.metadata["t.yes"] is True and h.metadata["t.bools"] == [True, False, True]
    assert (h.version, h.byte_order, h.alignment) == (3, "<", alignment or 32)
    assert h.data_offset % h.alignment == 0
    assert set(h.tensors) == set(ref_tensors)
    for name, info in h.tensors.items():
        ty, dims, offset, n_bytes, data = ref_tensors[name]
        assert (info.ggml_type, info.dims, info.offset, info.n_bytes) == (ty, dims, offset, n_bytes)
        assert tensor_bytes(path, info).tobytes() == data
    a = h.tensors["a.weight"]
    assert (a.type_name, a.shape, a.dims, a.n_elements) == ("F32", (3, 4), (4, 3), 12)
    assert h.tensors["c.q8"].type_name == "Q8_0" and h.tensors["c.q8"].n_bytes == 2 * 34 * 2
    assert read_gguf_metadata(path) == h.metadata


def test_big_endian_file(tmp_path):
    path = tmp_path / "be.gguf"
    _write(path, big_endian=True)
    h = read_gguf_header(path)
    assert h.byte_order == ">"
    assert h.metadata["t.u32"] == 4_000_000_000 and h.metadata["t.floats"] == [0.5, -1.25, 3.0]
    assert h.metadata["t.strings"][-1] == "😀" * 3
    assert h.tensors["a.weight"].dims == (4, 3)


def _cut_points(end: int, data_offset: int) -> list[int]:
    """File sizes to cut at: inside the fixed header, the key/values, the tensor infos, the data
    (``end`` is where the last tensor's data ends; the writer pads the file after it)."""
    return sorted({0, 3, 4, 8, 15, 23, 24, 31, 40, 100, data_offset // 2, data_offset - 1,
                   data_offset + 1, end - 1})


def test_every_truncation_is_a_checkpoint_error(small, tmp_path):
    data = small.read_bytes()
    h = read_gguf_header(small)
    end = max(t.offset + t.n_bytes for t in h.tensors.values())
    for n in _cut_points(end, h.data_offset):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(CheckpointError) as e:
            read_gguf_header(cut)
        msg = str(e.value)
        assert str(cut) in msg and "\n" not in msg
        assert ("truncated" in msg or "empty" in msg or "not a GGUF" in msg), msg


def test_truncated_tensor_is_named(small, tmp_path):
    info = read_gguf_header(small).tensors["c.q8"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small.read_bytes()[:info.offset + info.n_bytes - 10])  # c.q8 loses its end
    with pytest.raises(CheckpointError, match=r"truncated or corrupt: tensor 'c.q8' needs bytes"):
        read_gguf_header(cut)


def _corrupt(small, tmp_path, offset: int, packed: bytes):
    data = bytearray(small.read_bytes())
    data[offset:offset + len(packed)] = packed
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    return bad


def test_bad_magic_version_and_lengths(small, tmp_path):
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_gguf_header(_corrupt(small, tmp_path, 0, b"GGML"))
    with pytest.raises(CheckpointError, match="GGUF version 7 is not supported"):
        read_gguf_header(_corrupt(small, tmp_path, 4, struct.pack("<I", 7)))
    # the first key's length (right after the 24-byte fixed header) made huge
    with pytest.raises(CheckpointError, match="truncated or corrupt: the key of metadata entry #0"):
        read_gguf_header(_corrupt(small, tmp_path, 24, struct.pack("<Q", 2**40)))
    # the first value type (after "general.architecture") made unknown
    pos = 24 + 8 + len("general.architecture")
    with pytest.raises(CheckpointError, match="unknown GGUF value type 99"):
        read_gguf_header(_corrupt(small, tmp_path, pos, struct.pack("<I", 99)))
    # invalid UTF-8 in the architecture value ("llama")
    with pytest.raises(CheckpointError, match="not UTF-8"):
        read_gguf_header(_corrupt(small, tmp_path, pos + 4 + 8, b"\xff\xfe"))
    with pytest.raises(CheckpointError, match="counts"):
        read_gguf_header(_corrupt(small, tmp_path, 16, struct.pack("<Q", 2**60)))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        read_gguf_header(tmp_path / "nope.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty file"):
        read_gguf_header(tmp_path / "empty.gguf")


def test_long_header_is_read_past_the_first_chunk(tmp_path, monkeypatch):
    import models.gguf_metadata as gm

    path = tmp_path / "f.gguf"
    _write(path)
    monkeypatch.setattr(gm, "_FIRST_READ", 16)     # forces several longer reads
    assert read_gguf_metadata(path) == _reference(path)[0]
