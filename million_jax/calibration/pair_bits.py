"""Key bits allocated across RoPE pairs: pre-RoPE key codebooks of mixed widths at a fixed mean.

Pre-RoPE key codebooks give RoPE pair m (head dims m and m + d/2) its own 2-dim sub-space. The
error e_m of pair m enters a score as q_m . R(t) e_m; averaged over the rotation its variance is

    err[m, w] = E|q_m|^2 E|e_m(w)|^2 / 2        (w: the pair's code width in bits)

so pairs that queries read strongly, and whose keys are hard to code, deserve more bits. With
codebooks of several widths fitted on the same calibration keys, :func:`greedy_allocation` moves
one bit at a time from the pair where it costs least to the one where it saves most, the mean
width staying put; :func:`allocate_key_bits` does this once for the whole model (the summed error
over layers and KV heads: one code layout, which the cache and the kernel need static) and returns
codebooks whose key codes are stored at each pair's width (``PQCodebooks.key_parts``).

Measured on SmolLM2-135M (benchmarks/results/frontier/key_bits/): the 10 slowest of 32 pairs carry
81% of the weighted key error at 8 bits each; the model-wide allocation at a mean of 8 bits cuts it
to 0.50x.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from million_jax import rope
from million_jax.quant.kv_codebooks import PQCodebooks, unit_vectors
from million_jax.quant.kv_transforms import output_gram
from million_jax.quant.pq import Codebooks, decode, encode
from pallas_kernels.code_packing import Parts

__all__ = ["pair_query_energy", "pair_key_error", "subspace_error", "value_output_energy", "greedy_allocation",
           "shared_width_allocation", "widths_in_pair_order", "runs", "pad_centroids", "allocate_key_bits"]


def pair_query_energy(q_gram: np.ndarray, q_count: np.ndarray) -> np.ndarray:
    """E|q_m|^2 float64[L, Hkv, d/2] of each RoPE pair m (dims m and m + d/2, rotate-half) from the
    query Gram sums float[L, Hkv, d, d] and counts [L, Hkv] (``collect_query_gram``)."""
    g = np.asarray(q_gram, np.float64)
    n = np.asarray(q_count, np.float64)
    if g.ndim != 4 or g.shape[-1] != g.shape[-2] or g.shape[-1] % 2 or n.shape != g.shape[:2]:
        raise ValueError(f"q_gram must be float[L, Hkv, d, d] (d even) and q_count [L, Hkv], got {g.shape}, {n.shape}")
    if (n <= 0).any():
        raise ValueError("q_count has a (layer, KV head) with no queries: the query energies are undefined")
    diag = np.diagonal(g, axis1=-2, axis2=-1) / n[..., None]
    half = g.shape[-1] // 2
    return diag[..., :half] + diag[..., half:]


def pair_key_error(centroids: np.ndarray, keys: np.ndarray, *, norms: bool, unit: bool) -> np.ndarray:
    """E|k_m - k_hat_m|^2 float64[L, Hkv, d/2] per RoPE pair of pre-RoPE keys float[L, Hkv, N, d] coded
    by key centroids float[L, G, d/2, K, 2] (G in {1, Hkv}) as the cache codes them: ``unit`` codes
    encode k / |k|; with ``norms`` the reconstruction is rescaled to |k| (norm-explicit PQ)."""
    return subspace_error(centroids, keys, norms=norms, unit=unit, pair_layout=True)


def subspace_error(centroids: np.ndarray, x: np.ndarray, *, norms: bool, unit: bool, pair_layout: bool) -> np.ndarray:
    """E|x_m - x_hat_m|^2 float64[L, Hkv, d/2] per 2-dim sub-space of x float[L, Hkv, N, d] coded by
    centroids float[L, G, d/2, K, 2] (G in {1, Hkv}) as the cache codes them (``unit``, ``norms`` as
    :func:`pair_key_error`); sub-space m is RoPE pair m with ``pair_layout`` (keys before RoPE), else
    dims 2m, 2m + 1 (values)."""
    x = np.asarray(x, np.float32)
    c = np.asarray(centroids, np.float32)
    L, H, _, d = x.shape
    if c.shape[:1] != (L,) or c.shape[1] not in (1, H) or c.shape[2] != d // 2 or c.shape[4] != 2:
        raise ValueError(f"centroids must be float[L={L}, 1 or {H}, {d // 2}, K, 2], got {c.shape}")
    out = np.zeros((L, H, d // 2))
    for layer in range(L):
        xl = np.asarray(rope.to_pair_layout(x[layer], 1)) if pair_layout else x[layer]  # [H, N, d]
        x_in = unit_vectors(xl) if unit else xl
        books = Codebooks(c[layer])  # G = 1 broadcasts over the KV heads
        x_hat = np.asarray(decode(books, encode(books, x_in)), np.float32)
        if norms:
            x_hat = unit_vectors(x_hat) * np.linalg.norm(xl, axis=-1, keepdims=True)
        e = (xl - x_hat).astype(np.float64) ** 2
        out[layer] = e.reshape(H, -1, d // 2, 2).sum(-1).mean(1)
    return out


def value_output_energy(wo: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
    """float64[L, Hkv, d/2]: how much an error in value sub-space m (dims 2m, 2m + 1) of a KV head
    moves the attention layer's output, tr(G_mm) / 2 with G = sum over its query heads of Wo_h Wo_h^T
    (``wo`` float[L, H*d, D], ``y = x @ wo``; :func:`~million_jax.quant.kv_transforms.output_gram`):
    E|Wo^T e|^2 = sum_m tr(G_mm) E|e_m|^2 / 2 for errors isotropic within each sub-space and
    independent across them."""
    diag = np.diagonal(output_gram(wo, n_heads, n_kv_heads), axis1=-2, axis2=-1)  # [L, Hkv, d]
    if diag.shape[-1] % 2:
        raise ValueError(f"2-dim value sub-spaces need an even head_dim, got {diag.shape[-1]}")
    return diag.reshape(diag.shape[:2] + (-1, 2)).sum(-1) / 2


def greedy_allocation(err: np.ndarray, start: int) -> np.ndarray:
    """int[P] width indices for one error table float[P, W] (W consecutive widths): from ``start``
    everywhere, move one width step from the pair where it costs least to the one where it saves
    most while the saving is larger, so the mean width stays that of ``start``."""
    err = np.asarray(err, np.float64)
    P, n = err.shape
    if not 0 <= start < n:
        raise ValueError(f"start index {start} outside the {n} widths")
    a = np.full(P, start)
    rows = np.arange(P)
    while True:
        cur = err[rows, a]
        save = np.where(a < n - 1, cur - err[rows, np.minimum(a + 1, n - 1)], -np.inf)
        cost = np.where(a > 0, err[rows, np.maximum(a - 1, 0)] - cur, np.inf)
        i, j = int(np.argmax(save)), int(np.argmin(cost))
        if i == j or save[i] <= cost[j]:
            return a
        a[i] += 1
        a[j] -= 1


def widths_in_pair_order(slot_widths, perm: np.ndarray) -> np.ndarray:
    """int64[..., P]: the width of each pair in natural order, from the widths of the slots
    ``slot_widths`` [P] and the assignments ``perm`` int[..., P] (slot s codes pair ``perm[..., s]``;
    :func:`shared_width_allocation`)."""
    perm = np.asarray(perm)
    out = np.empty(perm.shape, np.int64)
    np.put_along_axis(out, perm, np.broadcast_to(np.asarray(slot_widths, np.int64), perm.shape), axis=-1)
    return out


def shared_width_allocation(err: np.ndarray, start: int, rounds: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """One width per slot for every group, each group free to order its pairs into the slots.

    err: float[G, P, W] (G groups, e.g. layer x KV head; W consecutive widths), start: the width
    index of the mean. Returns (slot width indices int[P], ascending; perm int[G, P]: slot s of
    group g codes pair ``perm[g, s]``). Alternates a greedy allocation over the slots (their errors
    summed over the groups) with each group's optimal assignment of its pairs to those slots, from
    two starts (the natural pair order, i.e. one allocation per pair for every group, and each
    group's pairs sorted by their error at ``start``), and keeps the best total: never worse than
    one width per pair for the model."""
    from scipy.optimize import linear_sum_assignment

    err = np.asarray(err, np.float64)
    G, P, W = err.shape
    best = (np.inf, None, None)
    for perm in (np.broadcast_to(np.arange(P), (G, P)), np.argsort(err[:, :, start], axis=1, kind="stable")):
        last = np.inf
        for _ in range(rounds):
            slots = np.take_along_axis(err, perm[..., None], 1).sum(0)  # [P, W]
            width = greedy_allocation(slots, start)
            order = np.argsort(width, kind="stable")
            width, perm = width[order], perm[:, order]
            new = np.empty((G, P), np.int64)
            for g in range(G):
                pairs, slot = linear_sum_assignment(err[g][:, width])
                new[g, slot] = pairs
            total = float(err[np.arange(G)[:, None], new, width[None, :]].sum())
            if total < best[0]:
                best = (total, width.copy(), new.copy())
            if total >= last * (1 - 1e-12):
                break
            last, perm = total, new
    return best[1], best[2]


def runs(widths) -> Parts:
    """The code layout ((count, bits), ...) of per-sub-space widths int[M]: runs of equal widths."""
    out: list[list[int]] = []
    for w in (int(x) for x in widths):
        if out and out[-1][1] == w:
            out[-1][0] += 1
        else:
            out.append([1, w])
    return tuple((n, b) for n, b in out)


def pad_centroids(by_width: Mapping[int, np.ndarray], widths) -> np.ndarray:
    """float32[L, G, P, 2**max(widths), 2]: sub-space m takes the centroids of width ``widths[..., m]``
    from ``by_width`` (bits -> float[L, G, P, 2**bits, 2]), padded with copies of its centroid 0.
    ``widths``: int[P] (one layout for the model) or anything broadcasting to [L, G, P]."""
    by_width = {int(w): np.asarray(c, np.float32) for w, c in by_width.items()}
    widths = np.asarray(widths, np.int64)
    missing = sorted(set(np.unique(widths).tolist()) - set(by_width))
    if missing:
        raise ValueError(f"no centroids of width {missing}")
    kmax = 2 ** int(widths.max())
    shape = next(iter(by_width.values())).shape[:3]
    out = np.zeros(shape + (kmax, 2), np.float32)
    for w in np.unique(widths).tolist():
        c = by_width[w]
        c = np.concatenate([c, np.repeat(c[..., :1, :], kmax - c.shape[-2], axis=-2)], axis=-2)
        out = np.where(np.broadcast_to(widths == w, shape)[..., None, None], c, out)
    return out


def allocate_key_bits(books: PQCodebooks, by_width: Mapping[int, np.ndarray], keys: np.ndarray,
                      q_gram: np.ndarray, q_count: np.ndarray, *, per_head_order: bool = False
                      ) -> tuple[PQCodebooks, dict]:
    """``books`` (pre-RoPE keys, one RoPE pair per key sub-space, one stage) with key codes of mixed
    widths at the mean of ``books.key_nbits``: one width per RoPE pair for the whole model, or, with
    ``per_head_order``, one width per key sub-space for the model and each (layer, KV head) putting
    its own pairs into those sub-spaces (:func:`shared_width_allocation`; ``key_pair_order``; needs
    codebooks per KV head).

    by_width: bits -> key centroids float[L, G, d/2, 2**bits, 2] fitted on the same keys (consecutive
    widths around ``books.key_nbits``; its own width is taken from ``books``); keys: pre-RoPE
    calibration keys float[L, Hkv, N, d] (a sample is enough); q_gram / q_count the query second
    moments. Returns (codebooks with ``key_parts``, a report: widths per pair (per sub-space with
    ``per_head_order``), the weighted error of the allocation and of each uniform width relative to
    ``books``)."""
    if books.key_rope != "pre" or books.key_rope_pairs != 1 or books.stages != 1:
        raise ValueError(f"per-pair key bits need pre-RoPE keys with one RoPE pair per sub-space and one stage, "
                         f"got {books.recipe}")
    if books.key_pair_order is not None or books.key_parts is not None:
        raise ValueError(f"allocate_key_bits takes codebooks of one width in the natural pair order (its "
                         f"errors are scored per RoPE pair), these are {books.recipe}")
    if per_head_order and books.granularity == "shared":
        raise ValueError("a pair order per layer and KV head needs codebooks per layer (granularity 'layer' with "
                         "one KV head, or 'layer_head'), these are 'shared'")
    if per_head_order and books.key.centroids.shape[1] != keys.shape[1]:
        raise ValueError(f"a pair order per KV head needs key codebooks per KV head (granularity layer_head), "
                         f"these have {books.key.centroids.shape[1]} group(s) for {keys.shape[1]} KV heads")
    by_width = {int(w): np.asarray(c, np.float32) for w, c in by_width.items()}
    by_width[books.key_nbits] = np.asarray(books.key.centroids, np.float32)
    widths = sorted(by_width)
    if widths != list(range(widths[0], widths[-1] + 1)):
        raise ValueError(f"the key widths must be consecutive, got {widths}")
    q2 = pair_query_energy(q_gram, q_count)  # [L, H, P]
    err = np.stack([q2 * pair_key_error(by_width[w], keys, norms=books.key_norms, unit=books.unit_codes) / 2
                    for w in widths], axis=-1)  # [L, H, P, W]
    total = err.sum((0, 1))  # [P, W]
    start = widths.index(books.key_nbits)
    base = float(total[:, start].sum())
    uniform = {f"uniform_{w}": float(total[:, j].sum()) / base for j, w in enumerate(widths)}
    if per_head_order:
        L, H, P, W = err.shape
        slot, perm = shared_width_allocation(err.reshape(L * H, P, W), start)
        perm = perm.reshape(L, H, P)
        bits = [widths[i] for i in slot]
        pair_bits = widths_in_pair_order(bits, perm)  # the width of each (layer, head, pair) in natural order
        cents = np.take_along_axis(pad_centroids(by_width, pair_bits), perm[..., None, None], axis=2)
        out = dataclasses.replace(books, key=Codebooks(cents)).with_key_pair_order(perm).with_key_parts(runs(bits))
        spent = float(err[np.arange(L)[:, None, None], np.arange(H)[None, :, None], perm, np.asarray(slot)].sum())
        report = {"key_bits_per_subspace": bits, "key_parts": [list(p) for p in runs(bits)],
                  "score_error_vs_uniform": {"allocation": spent / base, **uniform}}
        return out, report
    pick = greedy_allocation(total, start)
    bits = [widths[i] for i in pick]
    parts = runs(bits)
    cents = pad_centroids(by_width, bits)
    out = dataclasses.replace(books, key=Codebooks(cents)).with_key_parts(parts)
    report = {"key_bits_per_pair": bits, "key_parts": [list(p) for p in parts],
              "score_error_vs_uniform": {"allocation": float(total[np.arange(len(pick)), pick].sum()) / base,
                                         **uniform},
              "score_error_share_per_pair": (total[:, start] / base).tolist()}
    return out, report
