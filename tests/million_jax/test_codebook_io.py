import json
import os

import jax
import numpy as np
import pytest

from million_jax.quant.codebook_io import CodebookFileError, load_codebooks, save_codebooks
from million_jax.quant.pq import Codebooks, fit_codebooks


@pytest.fixture()
def books():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 64, 8)).astype(np.float32)
    k = fit_codebooks(x, 4, 3, key=jax.random.PRNGKey(0), iters=2)
    v = fit_codebooks(x * 2, 4, 3, key=jax.random.PRNGKey(1), iters=2)
    return {"key": k, "value": v}


def test_roundtrip(tmp_path, books):
    p = tmp_path / "cb.safetensors"
    save_codebooks(p, books, {"model_fingerprint": "abc", "tokens": 123})
    got, meta = load_codebooks(p, expect={"M": 4, "nbits": 3, "group_shape": [2, 3], "model_fingerprint": "abc"})
    assert meta == {"model_fingerprint": "abc", "tokens": 123}
    for name in books:
        np.testing.assert_array_equal(np.asarray(got[name].centroids), np.asarray(books[name].centroids))
    # no pickle: the file is a safetensors header (8-byte length + JSON) and raw data
    raw = p.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    json.loads(raw[8 : 8 + hlen])


@pytest.mark.parametrize(
    "expect, match",
    [
        ({"M": 8}, "M=4, expected 8"),
        ({"nbits": 4}, "nbits=3, expected 4"),
        ({"group_shape": [2, 2]}, "group_shape"),
        ({"model_fingerprint": "other"}, "model_fingerprint"),
    ],
)
def test_mismatch_is_clear(tmp_path, books, expect, match):
    p = tmp_path / "cb.safetensors"
    save_codebooks(p, books, {"model_fingerprint": "abc"})
    with pytest.raises(CodebookFileError, match=match):
        load_codebooks(p, expect=expect)


def test_truncated_file(tmp_path, books):
    p = tmp_path / "cb.safetensors"
    save_codebooks(p, books)
    data = p.read_bytes()
    for cut in (4, 50, len(data) - 10):
        q = tmp_path / f"cut{cut}.safetensors"
        q.write_bytes(data[:cut])
        with pytest.raises(CodebookFileError, match="corrupt or truncated"):
            load_codebooks(q)


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(CodebookFileError, match="not found"):
        load_codebooks(tmp_path / "nope.safetensors")
    from safetensors.numpy import save_file

    p = tmp_path / "foreign.safetensors"
    save_file({"w": np.zeros((2, 2), np.float32)}, str(p))
    with pytest.raises(CodebookFileError, match="no million-jax metadata"):
        load_codebooks(p)


def test_nan_centroids_rejected_on_load(tmp_path):
    c = np.zeros((4, 4, 2), np.float32)
    c[0, 0, 0] = np.nan
    p = tmp_path / "nan.safetensors"
    save_codebooks(p, {"key": Codebooks(c)})
    with pytest.raises(CodebookFileError, match="NaN"):
        load_codebooks(p)


def test_unserialisable_metadata(tmp_path, books):
    with pytest.raises(ValueError, match="JSON"):
        save_codebooks(tmp_path / "x.safetensors", books, {"bad": object()})
    assert not os.path.exists(tmp_path / "x.safetensors")


def test_save_keeps_mode_of_replaced_file_and_leaves_nothing_on_failure(tmp_path, books):
    p = tmp_path / "cb.safetensors"
    save_codebooks(p, books)
    mask = os.umask(0)
    os.umask(mask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~mask          # not safetensors' 0600
    os.chmod(p, 0o640)
    save_codebooks(p, books, {"second": True})
    assert p.stat().st_mode & 0o777 == 0o640
    assert load_codebooks(p)[1] == {"second": True}
    with pytest.raises(IsADirectoryError):
        save_codebooks(tmp_path, books)
    with pytest.raises(ValueError, match="JSON"):
        save_codebooks(p, books, {"bad": object()})
    assert sorted(os.listdir(tmp_path)) == ["cb.safetensors"]   # no .tmp left behind


def test_edited_stages_are_caught_by_the_recorded_head_dim(tmp_path):
    """A K/V file whose metadata `stages` was edited would re-read the key tensor as residual
    stages of half the head_dim; the recorded head_dim catches it with a clear error."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    from million_jax.calibration.fit import fit_kv_codebooks
    from million_jax.quant.codebook_io import load_kv_codebooks, save_kv_codebooks

    x = np.random.default_rng(0).standard_normal((2, 2, 100, 16)).astype(np.float32)
    kv = fit_kv_codebooks(x, x, M=8, nbits=3, key=jax.random.key(0), iters=1)
    path = tmp_path / "kv.safetensors"
    save_kv_codebooks(path, kv)
    assert load_kv_codebooks(path)[0].head_dim == 16
    with safe_open(str(path), framework="numpy") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    header = json.loads(meta["million_jax"])
    header["user"]["stages"] = 2
    save_file(tensors, str(tmp_path / "edited.safetensors"), {**meta, "million_jax": json.dumps(header)})
    with pytest.raises(CodebookFileError, match="metadata and the tensors disagree: head_dim 16 recorded.*gives head_dim 8"):
        load_kv_codebooks(tmp_path / "edited.safetensors")
