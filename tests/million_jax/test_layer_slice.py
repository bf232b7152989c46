"""LayerSlice reads and write_rows against NumPy on fresh random inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from million_jax.cache.base import write_rows
from million_jax.attention.layer_slice import LayerSlice, as_array, rows, take_rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint8])
def test_layer_slice_reads_match_indexing(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 200, size=(3, 2, 2, 17, 5)), dtype)
    ref = np.asarray(x.astype(jnp.float32))
    idx = jnp.asarray([[0, 4, 16, 30], [-3, 2, 2, 9]], jnp.int32)  # out of range: clipped
    for layer in range(3):
        view = LayerSlice(x, jnp.int32(layer))
        assert view.shape == x.shape[1:] and view.dtype == x.dtype and view.ndim == 4
        np.testing.assert_array_equal(np.asarray(as_array(view).astype(jnp.float32)), ref[layer])
        got = jax.jit(lambda s: rows(LayerSlice(x, s), 5, 8))(jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), ref[layer][:, :, 5:13])
        np.testing.assert_array_equal(np.asarray(rows(x[layer], 5, 8).astype(jnp.float32)), ref[layer][:, :, 5:13])
        ci = np.clip(np.asarray(idx), 0, 16)
        want = np.stack([ref[layer][b][:, ci[b]] for b in range(2)])
        np.testing.assert_array_equal(np.asarray(take_rows(view, idx).astype(jnp.float32)), want)
        np.testing.assert_array_equal(np.asarray(take_rows(x[layer], idx).astype(jnp.float32)), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint8])
@pytest.mark.parametrize("r", [1, 5])
def test_write_rows_matches_numpy(dtype, r):
    rng = np.random.default_rng(r)
    b, hkv, n, d = 2, 3, 48, 4
    buf = jnp.asarray(rng.integers(0, 100, size=(b, hkv, n, d)), dtype)
    vals = jnp.asarray(rng.integers(100, 200, size=(b, r, hkv, d)), dtype)
    rws = np.stack([rng.permutation(n + 4)[:r] for _ in range(b)]).astype(np.int32)  # some >= n: dropped
    rws[0, 0] = n  # the "don't write" index
    out = jax.jit(write_rows)(buf, jnp.asarray(rws), vals)
    want = np.asarray(buf.astype(jnp.float32)).copy()
    v = np.asarray(vals.astype(jnp.float32))
    for i in range(b):
        for j in range(r):
            if rws[i, j] < n:
                want[i, :, rws[i, j]] = v[i, j]
    assert out.dtype == buf.dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
