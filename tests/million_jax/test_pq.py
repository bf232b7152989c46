import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from million_jax.quant.pq import (
    Codebooks,
    bits_per_element,
    code_dtype,
    decode,
    encode,
    fit_codebooks,
    reconstruction_mse,
)


def _data(seed, shape):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32)


@settings(max_examples=6)  # each example compiles new shapes (~3 s on 2 cores)
@given(
    seed=st.integers(0, 1000),
    groups=st.sampled_from([(), (2,), (2, 3)]),
    d_m=st.sampled_from([(8, 4), (8, 2), (16, 8), (12, 3)]),
    nbits=st.sampled_from([1, 3, 5]),
)
@pytest.mark.slow
def test_shapes_dtypes_and_nearest(seed, groups, d_m, nbits):
    d, M = d_m
    x = _data(seed, groups + (64, d))
    cb = fit_codebooks(x, M, nbits, key=jax.random.PRNGKey(seed), iters=3)
    assert cb.centroids.shape == groups + (M, 2**nbits, d // M)
    assert cb.centroids.dtype == np.float32
    codes = encode(cb, x)
    assert codes.shape == groups + (64, M) and codes.dtype == np.uint8
    xhat = decode(cb, codes)
    assert xhat.shape == x.shape
    # each code is the nearest centroid of its sub-vector (brute force in numpy)
    c = np.asarray(cb.centroids)
    xs = x.reshape(groups + (64, M, d // M))
    dist = ((xs[..., None, :] - np.expand_dims(c, -4)) ** 2).sum(-1)  # [*G, N, M, K]
    best = dist.min(-1)
    chosen = np.take_along_axis(dist, np.asarray(codes)[..., None].astype(int), -1)[..., 0]
    np.testing.assert_allclose(chosen, best, rtol=1e-5, atol=1e-6)


def test_uint16_for_wide_codes_and_bits_accounting():
    assert code_dtype(8) == np.uint8 and code_dtype(9) == np.uint16 and code_dtype(12) == np.uint16
    assert bits_per_element(128, 64, 8) == 4.0
    assert bits_per_element(128, 32, 12) == 3.0
    x = _data(0, (1200, 4))
    cb = fit_codebooks(x, 2, 10, key=jax.random.PRNGKey(0), iters=2)
    codes = encode(cb, x)
    assert codes.dtype == np.uint16 and int(np.asarray(codes).max()) < 1024


@pytest.mark.slow
def test_error_falls_as_nbits_grows():
    x = _data(1, (2, 2048, 16))
    errs = [
        float(reconstruction_mse(fit_codebooks(x, 8, nb, key=jax.random.PRNGKey(0), iters=10), x))
        for nb in (1, 2, 4, 6, 8)
    ]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.05 * errs[0]


def test_shared_codebook_broadcasts_over_groups():
    x = _data(2, (3, 2, 100, 8))
    cb = fit_codebooks(x.reshape(-1, 8), 4, 4, key=jax.random.PRNGKey(0), iters=3)
    codes = encode(cb, x)
    assert codes.shape == (3, 2, 100, 4)
    np.testing.assert_array_equal(np.asarray(codes).reshape(-1, 4), np.asarray(encode(cb, x.reshape(-1, 8))))


def test_chunked_encode_matches_unchunked():
    x = _data(3, (1000, 8))
    cb = fit_codebooks(x, 4, 6, key=jax.random.PRNGKey(0), iters=3)
    np.testing.assert_array_equal(np.asarray(encode(cb, x, chunk_size=37)), np.asarray(encode(cb, x)))


def test_deterministic():
    x = _data(4, (300, 8))
    a = fit_codebooks(x, 4, 4, key=jax.random.PRNGKey(3))
    b = fit_codebooks(x, 4, 4, key=jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(a.centroids), np.asarray(b.centroids))


@pytest.mark.parametrize(
    "shape, M, nbits, match",
    [
        ((100, 10), 4, 4, "not divisible"),
        ((100, 8), 4, 0, r"nbits must be an int in \[1, 12\]"),
        ((100, 8), 4, 13, r"nbits must be an int in \[1, 12\]"),
        ((100, 8), 4, 8, "fewer than the K=2\\*\\*8=256"),
        ((100, 8), 0, 2, "positive int"),
    ],
)
def test_bad_inputs(shape, M, nbits, match):
    with pytest.raises(ValueError, match=match):
        fit_codebooks(_data(0, shape), M, nbits, key=jax.random.PRNGKey(0))


def test_nan_input_rejected():
    x = _data(0, (100, 8))
    x[5, 3] = np.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        fit_codebooks(x, 4, 2, key=jax.random.PRNGKey(0))


def test_mismatched_dims_rejected():
    cb = fit_codebooks(_data(0, (100, 8)), 4, 2, key=jax.random.PRNGKey(0), iters=2)
    with pytest.raises(ValueError, match="does not match the codebook"):
        encode(cb, _data(0, (10, 16)))
    with pytest.raises(ValueError, match="M=4"):
        decode(cb, np.zeros((10, 3), np.uint8))
    with pytest.raises(ValueError, match="power of two"):
        Codebooks(np.zeros((4, 3, 2), np.float32)).validate()


def test_decode_rejects_codes_out_of_range_and_bad_groups():
    x = _data(5, (2, 300, 8))
    cb = fit_codebooks(x, 4, 3, key=jax.random.PRNGKey(0), iters=1)          # K = 8, G = (2,)
    codes = np.asarray(encode(cb, x))
    np.testing.assert_array_equal(np.isfinite(np.asarray(decode(cb, codes))), True)
    bad = codes.copy()
    bad[1, 7, 2] = 8                                                           # one code == K
    with pytest.raises(ValueError, match=r"codes must be in \[0, 8\).*\[0, 8\]"):
        decode(cb, bad)
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        decode(cb, codes.astype(np.int32) - 1)                                 # negative codes
    with pytest.raises(ValueError, match="group axes"):
        decode(cb, codes[:1].repeat(3, axis=0))                                # 3 groups vs 2
    # under jit the values are unknown: no host check, the shape check still applies
    assert jax.jit(lambda c: decode(cb, c))(codes).shape == (2, 300, 8)


def test_encode_rejects_mismatched_group_axes():
    cb = fit_codebooks(_data(6, (2, 300, 8)), 4, 3, key=jax.random.PRNGKey(0), iters=1)
    with pytest.raises(ValueError, match=r"encode: x leading axes \(3,\).*group axes \(2,\)"):
        encode(cb, _data(7, (3, 10, 8)))
    assert encode(cb, _data(7, (10, 8))).shape == (2, 10, 4)                  # broadcasts
