"""million_jax.rope against a NumPy oracle written pair by pair."""
import numpy as np
import pytest

from million_jax import rope


def _oracle_rotate(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """float64: pair i = (x[i], x[i + d/2]) times the 2x2 rotation by angles[..., i]."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for i in range(half):
        c, s = np.cos(angles[..., i]), np.sin(angles[..., i])
        out[..., i] = x[..., i] * c - x[..., i + half] * s
        out[..., i + half] = x[..., i + half] * c + x[..., i] * s
    return out


def test_rotate_matches_pairwise_oracle_and_unrotate_inverts():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    positions = rng.integers(0, 4096, size=(3, 5))
    inv = rope.rope_inv_freq(16, 10000.0)
    cos, sin = rope.rope_cos_sin(positions, inv)
    got = np.asarray(rope.rotate(x, cos, sin))
    want = _oracle_rotate(x.astype(np.float64), positions[..., None] * inv.astype(np.float64))
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)  # float32 angles at t ~ 4K
    np.testing.assert_allclose(np.asarray(rope.unrotate(got, cos, sin)), x, atol=1e-5)
    assert not np.allclose(got, x, atol=1e-2)


def test_pair_layout_round_trip_and_pairs_adjacent():
    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    paired = np.asarray(rope.to_pair_layout(x))
    np.testing.assert_array_equal(paired[0], [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(np.asarray(rope.from_pair_layout(paired)), x)


def test_two_pairs_per_subspace_put_pair_m_beside_pair_m_plus_d_over_4():
    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)  # 4 pairs: (0, 4), (1, 5), (2, 6), (3, 7)
    paired = np.asarray(rope.to_pair_layout(x, 2))
    np.testing.assert_array_equal(paired[0], [0, 4, 2, 6, 1, 5, 3, 7])  # sub-space 0: pairs 0, 2; 1: pairs 1, 3
    np.testing.assert_array_equal(np.asarray(rope.from_pair_layout(paired, 2)), x)
    np.testing.assert_array_equal(rope.subspace_freqs(np.array([10, 11, 12, 13], np.float32), 2),
                                  [[10, 12], [11, 13]])
    rng = np.random.default_rng(3)  # rotating in pair layout follows the same order of frequencies
    y = rng.standard_normal((5, 16)).astype(np.float32)
    inv = rope.rope_inv_freq(16, 10000.0)
    cos, sin = rope.rope_cos_sin(np.arange(5), inv)
    fc, fs = rope.rope_cos_sin(np.arange(5), rope.subspace_freqs(inv, 2).reshape(-1))
    np.testing.assert_allclose(np.asarray(rope.rotate_pair_layout(rope.to_pair_layout(y, 2), fc, fs)),
                               np.asarray(rope.to_pair_layout(rope.rotate(y, cos, sin), 2)), atol=1e-6)
    for bad in (0, 3, 1.0, True):
        with pytest.raises(ValueError, match="pairs per sub-space must be an integer >= 1 dividing"):
            rope.to_pair_layout(x, bad)


def test_rotation_stays_inside_each_pair_subspace():
    """In pair layout, rotating changes sub-space m (dims 2m, 2m+1) only through angle m."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(8).astype(np.float32)
    angles = np.zeros(4, np.float32)
    angles[2] = 0.7
    got = np.asarray(rope.to_pair_layout(rope.rotate(x, np.cos(angles), np.sin(angles))))
    before = np.asarray(rope.to_pair_layout(x))
    changed = np.flatnonzero(np.abs(got - before) > 1e-6)
    np.testing.assert_array_equal(changed, [4, 5])


@pytest.mark.parametrize("head_dim", [0, 7, -2])
def test_odd_or_empty_head_dim_is_refused(head_dim):
    with pytest.raises(ValueError, match="even head_dim"):
        rope.rope_inv_freq(head_dim, 10000.0)


def test_bad_scaling_is_refused():
    with pytest.raises(ValueError, match="freq_factors has 2 entries"):
        rope.rope_inv_freq(8, 10000.0, rope.RopeScaling("freq_factors", freq_factors=(1.0, 2.0)))
    with pytest.raises(ValueError, match="unsupported rope scaling kind 'yarn'"):
        rope.rope_inv_freq(8, 10000.0, rope.RopeScaling("yarn"))


def test_rotate_pair_layout_equals_rotate_in_the_other_layout():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 16)).astype(np.float32)
    cos, sin = rope.rope_cos_sin(rng.integers(0, 1 << 17, size=(4, 3)), rope.rope_inv_freq(16, 10000.0))
    want = np.asarray(rope.to_pair_layout(rope.rotate(x, cos, sin)))
    got = np.asarray(rope.rotate_pair_layout(rope.to_pair_layout(x), cos, sin))
    np.testing.assert_allclose(got, want, atol=1e-6)
