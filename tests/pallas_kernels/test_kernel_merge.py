"""merge_partials / merge_stacked: log-sum-exp combination of attention partials."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import merge_partials, merge_stacked


def attend(scores: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores [B, H, T], values [B, H, T, d] -> (out [B, H, d], lse [B, H]); empty T -> 0, -inf."""
    if scores.shape[-1] == 0:
        return np.zeros(values.shape[:2] + values.shape[-1:]), np.full(scores.shape[:2], -np.inf)
    m = scores.max(-1, keepdims=True)
    p = np.exp(scores - m)
    return np.einsum("bht,bhtd->bhd", p, values) / p.sum(-1)[..., None], m[..., 0] + np.log(p.sum(-1))


@settings(max_examples=25, deadline=None, database=None)
@given(
    cuts=st.lists(st.integers(0, 12), min_size=0, max_size=4),
    seed=st.integers(0, 2**31 - 1),
    spread=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_merging_disjoint_partials_equals_full_attention(cuts, seed, spread) -> None:
    """Attention over T keys == merge of attention over any partition (empty parts allowed)."""
    rng = np.random.default_rng(seed)
    b, h, t, d = 2, 3, 12, 4
    scores = spread * rng.standard_normal((b, h, t))
    values = rng.standard_normal((b, h, t, d))
    edges = [0, *sorted(cuts), t]
    parts = [attend(scores[..., lo:hi], values[:, :, lo:hi]) for lo, hi in zip(edges[:-1], edges[1:])]
    order = rng.permutation(len(parts))  # order does not matter
    out, lse = merge_partials([jnp.asarray(parts[i][0]) for i in order], [jnp.asarray(parts[i][1]) for i in order])
    ref_out, ref_lse = attend(scores, values)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-5, rtol=1e-5)


def test_all_empty_is_zero_and_neg_inf_without_nan() -> None:
    out = jnp.full((2, 3, 4), jnp.nan)  # whatever an empty partial holds is ignored
    lse = jnp.full((2, 3), -jnp.inf)
    o, l = merge_partials([out, jnp.zeros((2, 3, 4))], [lse, lse])
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(l)))


def test_empty_partial_with_garbage_is_ignored_and_single_partial_is_identity() -> None:
    rng = np.random.default_rng(0)
    o1, l1 = jnp.asarray(rng.standard_normal((1, 2, 8))), jnp.asarray(rng.standard_normal((1, 2)))
    o, l = merge_partials([o1, jnp.full((1, 2, 8), jnp.inf)], [l1, jnp.full((1, 2), -jnp.inf)])
    np.testing.assert_allclose(np.asarray(o), np.asarray(o1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l), np.asarray(l1), rtol=1e-6)
    o, l = merge_partials([o1.astype(jnp.bfloat16)], [l1])
    assert o.dtype == jnp.float32 and l.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o), np.asarray(o1.astype(jnp.bfloat16).astype(jnp.float32)))


def test_merge_stacked_axis_and_large_lse() -> None:
    """Stacked form on a middle axis; huge lse values do not overflow."""
    out = jnp.stack([jnp.ones((2, 4)), 3 * jnp.ones((2, 4))], axis=1)  # [2, P=2, 4]
    lse = jnp.array([[1000.0, 1000.0], [-jnp.inf, 5.0]])
    o, l = merge_stacked(out, lse, axis=1)
    np.testing.assert_allclose(np.asarray(o), [[2.0] * 4, [3.0] * 4])
    np.testing.assert_allclose(np.asarray(l), [1000.0 + np.log(2.0), 5.0])


def test_merge_errors() -> None:
    a, la = jnp.zeros((1, 2, 4)), jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="as many"):
        merge_partials([a, a], [la])
    with pytest.raises(ValueError, match="as many"):
        merge_partials([], [])
    with pytest.raises(ValueError, match="partial 1"):
        merge_partials([a, jnp.zeros((1, 3, 4))], [la, jnp.zeros((1, 3))])
    with pytest.raises(ValueError, match="lse"):
        merge_partials([a], [jnp.zeros((1, 3))])


def test_nan_partial_makes_the_row_nan_instead_of_being_dropped() -> None:
    """A NaN score is bad input: its row's merged result is NaN (never a finite answer from the
    other partials); rows without NaN and all-empty rows are unchanged."""
    rng = np.random.default_rng(1)
    o1, l1 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3))
    o2, l2 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3))
    l2[0, 1] = np.nan
    o2[0, 1] = np.nan
    l1[1, 2] = l2[1, 2] = -np.inf  # an all-empty row stays 0 / -inf
    o, l = (np.asarray(x) for x in merge_partials([jnp.asarray(o1), jnp.asarray(o2)], [jnp.asarray(l1), jnp.asarray(l2)]))
    assert np.isnan(o[0, 1]).all() and np.isnan(l[0, 1])
    ok = np.ones((2, 3), bool)
    ok[0, 1] = ok[1, 2] = False
    assert np.isfinite(o[ok]).all() and np.isfinite(l[ok]).all()
    assert np.all(o[1, 2] == 0) and np.isneginf(l[1, 2])


def test_online_softmax_propagates_nan_and_inf_scores_like_a_plain_softmax() -> None:
    """OnlineSoftmax over two tiles: a NaN or +inf score gives a NaN row, as jax.nn.softmax does."""
    from pallas_kernels.softmax import OnlineSoftmax
    import jax
    rng = np.random.default_rng(2)
    scores = rng.standard_normal((1, 1, 1, 3, 8)).astype(np.float32)
    scores[0, 0, 0, 0, 5] = np.nan
    scores[0, 0, 0, 1, 2] = np.inf
    values = jnp.asarray(rng.standard_normal((1, 1, 8, 4)), jnp.float32)
    mask = jnp.ones(scores.shape, bool)
    state = OnlineSoftmax.init(scores.shape[:-1], 4)
    for lo, hi in ((0, 4), (4, 8)):
        state = state.step(jnp.asarray(scores[..., lo:hi]), mask[..., lo:hi], values[:, :, lo:hi])
    out, lse = (np.asarray(x) for x in state.finish())
    plain = np.asarray(jnp.einsum("bkgrs,bksd->bkgrd", jax.nn.softmax(jnp.asarray(scores), -1), values))
    assert np.isnan(plain[0, 0, 0, :2]).all()  # the behaviour matched
    assert np.isnan(out[0, 0, 0, :2]).all() and np.isnan(lse[0, 0, 0, :2]).all()
    np.testing.assert_allclose(out[0, 0, 0, 2], plain[0, 0, 0, 2], rtol=1e-5, atol=1e-6)
