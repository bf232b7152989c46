"""Log-sum-exp combination of partial attention results (pure jnp, runs anywhere).

A partial is the attention of one query over a subset of the keys: `out` is the softmax
-weighted mean of the values over that subset and `lse` the natural log of the sum of
exp(score) over it (-inf for an empty subset, where `out` is ignored). Partials over
disjoint subsets combine exactly:

    lse = log sum_i exp(lse_i),   out = sum_i exp(lse_i - lse) * out_i.

Used for the split-K partials of the decode kernel and to merge the PQ-code part with the
exact full-precision (ring / sink) part of a cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["merge_partials", "merge_stacked"]


def merge_stacked(out: jax.Array, lse: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Merges partials stacked along `axis`.

    Args:
      out: float[..., P, ..., d]: partial outputs, the partial index on `axis` (counted on
        `lse`'s dims; `out` has one trailing feature dim more than `lse`).
      lse: float[..., P, ...]: partial log-sum-exps, -inf for empty partials.
      axis: the partial axis of `lse` (negative values count from `lse`'s end).

    Returns:
      (out float32[lse.shape without axis + (d,)], lse float32[lse.shape without axis]).
      All-empty rows give out = 0 and lse = -inf; never NaN from empty partials, whatever
      their `out` holds.
    """
    if out.ndim != lse.ndim + 1 or out.shape[:-1] != lse.shape:
        raise ValueError(
            f"merge: out must be lse.shape + (d,); got out {out.shape}, lse {lse.shape}"
        )
    axis = axis % lse.ndim
    out = out.astype(jnp.float32)
    lse = lse.astype(jnp.float32)
    m = jnp.max(lse, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty partials
    denom = jnp.sum(w, axis=axis)
    weighted = jnp.where(w[..., None] > 0, w[..., None] * out, 0.0)
    num = jnp.sum(weighted, axis=axis)
    nonempty = denom > 0
    merged_out = num / jnp.where(nonempty, denom, 1.0)[..., None]
    merged_lse = jnp.where(nonempty, jnp.squeeze(m_safe, axis) + jnp.log(jnp.where(nonempty, denom, 1.0)), -jnp.inf)
    return merged_out, merged_lse


def merge_partials(
    outs: Sequence[jax.Array], lses: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Combines attention partials over disjoint key sets by log-sum-exp.

    Args:
      outs: sequence of float[B, H, d] (any float dtype; all the same shape).
      lses: sequence of float[B, H] (natural log; -inf where a partial saw no key).

    Returns:
      (out float32[B, H, d], lse float32[B, H]); out = 0 and lse = -inf where every partial
      is empty. Safe with all -inf (no NaN).
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(
            f"merge_partials: need as many outs as lses (>= 1); got {len(outs)} and {len(lses)}"
        )
    for i, (o, l) in enumerate(zip(outs, lses)):
        if o.shape != outs[0].shape or l.shape != lses[0].shape:
            raise ValueError(
                f"merge_partials: partial {i} has out {o.shape}, lse {l.shape}; "
                f"partial 0 has out {outs[0].shape}, lse {lses[0].shape}"
            )
        if o.shape[:-1] != l.shape:
            raise ValueError(f"merge_partials: out {o.shape} must be lse {l.shape} + (d,)")
    if len(outs) == 1:
        return merge_stacked(outs[0][None], lses[0][None], axis=0)
    return merge_stacked(jnp.stack(outs), jnp.stack(lses), axis=0)
