"""The softmax-attention math in pure jnp: one home for every attention path of million-jax.

Every attention in the project (dense, exact window, PQ and uniform codes, the Pallas kernel's
reference) is "scores -> masked softmax -> weighted sum of values", possibly over several
disjoint key sets whose partial results are merged by log-sum-exp. This module holds that math
once; callers only compute their scores and their values.

Layout (GQA explicit): ``Hkv`` KV heads, ``G = H // Hkv`` query heads per KV head, ``R`` query
rows per head (the T query tokens of a call), ``S`` keys:

    scores:  f32[B, Hkv, G, R, S]
    mask:    bool, broadcastable to scores (True = key visible)
    values:  float[B, Hkv, S, d]
    state:   OnlineSoftmax(m f32[B, Hkv, G, R], l f32[B, Hkv, G, R], acc f32[B, Hkv, G, R, d])

A partial result is ``(out, lse)``: the softmax-weighted mean of the values over a key subset
and ``lse = log sum exp(score)`` over it (natural log, -inf for an empty subset, whose ``out``
is 0 and is ignored by the merge). Partials over disjoint subsets combine exactly:

    lse = log sum_i exp(lse_i),   out = sum_i exp(lse_i - lse) * out_i

Nothing here ever produces NaN from an empty key set, and nothing drops a NaN score: it
propagates to the row's output as in a plain softmax. The Pallas kernel body keeps its own
in-register copy of the online-softmax step (Triton needs 2-D tiles and ``tl.dot``); its
reference is written with these functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "OnlineSoftmax",
    "einsum_f32",
    "group_heads",
    "ungroup_heads",
    "softmax_attention",
    "merge_partials",
    "merge_stacked",
]


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with float32 accumulation and result.

    On accelerators low-precision operands go to the dot unit as they are. XLA's CPU runtime
    has no BF16 x BF16 -> F32 dot for every shape ("Unsupported element type for DotThunk"),
    so there the operands are upcast first (exact).
    """
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def group_heads(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q float[B, T, H, d] -> float[B, Hkv, G, T, d]; query head h reads KV head h // G."""
    b, t, h, d = q.shape
    if num_kv_heads < 1 or h % num_kv_heads:
        raise ValueError(f"query heads {h} not a multiple of kv heads {num_kv_heads}")
    return jnp.transpose(q.reshape(b, t, num_kv_heads, h // num_kv_heads, d), (0, 2, 3, 1, 4))


def ungroup_heads(x: jax.Array) -> jax.Array:
    """float[B, Hkv, G, T, ...] -> float[B, T, H, ...] (inverse of :func:`group_heads`)."""
    b, hkv, g, t = x.shape[:4]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape((b, t, hkv * g) + x.shape[4:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """Running state of a softmax over key tiles (see the module docstring for shapes)."""

    m: jax.Array  # running max of the scores (-inf: nothing seen yet)
    l: jax.Array  # running sum of exp(score - m)
    acc: jax.Array  # running sum of exp(score - m) * value

    @classmethod
    def init(cls, lead: Sequence[int], d: int) -> "OnlineSoftmax":
        """The empty state for scores of shape ``lead + (S,)``, values of width d."""
        lead = tuple(lead)
        return cls(
            m=jnp.full(lead, -jnp.inf, jnp.float32),
            l=jnp.zeros(lead, jnp.float32),
            acc=jnp.zeros(lead + (d,), jnp.float32),
        )

    def step(self, scores: jax.Array, mask: jax.Array, values: jax.Array) -> "OnlineSoftmax":
        """Fold one tile of keys in: scores f32[B, Hkv, G, R, n], values float[B, Hkv, n, d].

        Probabilities are cast to the values' dtype for the P.V product (as HF eager attention
        does), accumulated in f32.
        """
        scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
        m_new = jnp.maximum(self.m, jnp.max(scores, axis=-1))
        # Only "nothing seen yet" (-inf) is special: a NaN or +inf score makes the row NaN, as
        # a plain softmax would, instead of being dropped as if the row were empty.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(mask, jnp.exp(scores - m_safe[..., None]), 0.0)
        alpha = jnp.where(self.m == -jnp.inf, 0.0, jnp.exp(self.m - m_safe))
        pv = einsum_f32("bkgrs,bksd->bkgrd", p.astype(values.dtype), values)
        return OnlineSoftmax(
            m=m_new, l=self.l * alpha + jnp.sum(p, axis=-1), acc=self.acc * alpha[..., None] + pv
        )

    def finish(self) -> tuple[jax.Array, jax.Array]:
        """(out f32[B, Hkv, G, R, d], lse f32[B, Hkv, G, R]); a row that saw no key: 0 / -inf.

        A row that saw a NaN (or +inf) score gives NaN out and lse, which the merge propagates.
        """
        empty = self.l == 0
        l_safe = jnp.where(empty, 1.0, self.l)
        out = self.acc / l_safe[..., None]
        lse = jnp.where(empty, -jnp.inf, self.m + jnp.log(l_safe))
        return out, lse


def softmax_attention(
    scores: jax.Array, mask: jax.Array, values: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention over all S keys at once: one step of :class:`OnlineSoftmax`.

    scores f32[B, Hkv, G, R, S], mask broadcastable, values float[B, Hkv, S, d] ->
    (out f32[B, Hkv, G, R, d], lse f32[B, Hkv, G, R]).
    """
    state = OnlineSoftmax.init(scores.shape[:-1], values.shape[-1])
    return state.step(scores, mask, values).finish()


def merge_stacked(out: jax.Array, lse: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Merges partials stacked along ``axis`` (counted on ``lse``'s dims).

    out: float[..., P, ..., d] (one trailing feature dim more than lse); lse: float[..., P, ...],
    -inf for empty partials. Returns (out f32[lse.shape without axis + (d,)], lse f32[...]);
    all-empty rows give out = 0 and lse = -inf, never NaN, whatever empty partials hold. A NaN
    partial (NaN lse, from a NaN score) makes the merged row NaN: bad input is never dropped.
    """
    if out.ndim != lse.ndim + 1 or out.shape[:-1] != lse.shape:
        raise ValueError(f"merge: out must be lse.shape + (d,); got out {out.shape}, lse {lse.shape}")
    axis = axis % lse.ndim
    out = out.astype(jnp.float32)
    lse = lse.astype(jnp.float32)
    m = jnp.max(lse, axis=axis, keepdims=True)  # NaN if any partial is NaN
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    empty = lse == -jnp.inf
    w = jnp.where(empty, 0.0, jnp.exp(lse - m_safe))
    denom = jnp.sum(w, axis=axis)
    num = jnp.sum(jnp.where(empty[..., None], 0.0, w[..., None] * out), axis=axis)
    none = denom == 0
    d_safe = jnp.where(none, 1.0, denom)
    merged_lse = jnp.where(none, -jnp.inf, jnp.squeeze(m_safe, axis) + jnp.log(d_safe))
    return num / d_safe[..., None], merged_lse


def merge_partials(
    outs: Sequence[jax.Array], lses: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Combines any number of partials over disjoint key sets by log-sum-exp.

    outs: float[..., d] each (same shape); lses: float[...] each (-inf: the partial saw no key).
    Returns (out f32[..., d], lse f32[...]).
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(
            f"merge_partials: need as many outs as lses (>= 1); got {len(outs)} and {len(lses)}"
        )
    for i, (o, s) in enumerate(zip(outs, lses)):
        if o.shape != outs[0].shape or s.shape != lses[0].shape:
            raise ValueError(
                f"merge_partials: partial {i} has out {o.shape}, lse {s.shape}; "
                f"partial 0 has out {outs[0].shape}, lse {lses[0].shape}"
            )
        if o.shape[:-1] != s.shape:
            raise ValueError(f"merge_partials: out {o.shape} must be lse {s.shape} + (d,)")
    return merge_stacked(jnp.stack(outs), jnp.stack(lses), axis=0)
