"""Rebuilding BPE merges from a SentencePiece vocabulary (GGUF files store none for ``llama``).

A merge ``(l, r)`` exists for every token ``t`` and every cut ``t = l + r`` where
both ``l`` and ``r`` are tokens. The merges are ranked best-first by

    1. the token's priority, higher first (its score, or minus its position for Gemma);
    2. the longer left piece first, then the longer right piece;
    3. the token's first position in the vocabulary.

This is the order HF transformers derives for GGUF files
(``tokenization_utils_base.generate_merges``), so a tokenizer built from these
merges gives HF's ids. A token string listed twice counts once: its id and
priority are those of its last occurrence, its position the first.

Speed: Gemma 3's 262,144 tokens have 1.2M cuts (515K of them merges). Testing
each with two dict lookups takes 0.85 s of CPU in Python (3-4 s of wall time on
a loaded 2-core machine); ``rebuild_merges`` does it in numpy in 0.45 s: the
tokens become zero-padded matrices of code points (+1, so NUL is not padding),
every prefix gets a polynomial hash mod 2^64 (one pass over the columns), every
suffix's hash follows from two prefix hashes, both are looked up in a
vectorized hash table of the whole tokens' hashes, and every hit is verified by
comparing code points, so the result is exact. Tokens longer than
``_VECTOR_MAX_LEN`` (rare) take the plain Python path, and so does everything
in the unlikely case of two tokens with equal hashes. Ranking and building the
list of string pairs take another ~0.3 s.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["rebuild_merges", "rebuild_merges_python"]

_VECTOR_MAX_LEN = 64      # longer tokens are cut in Python (few: their pieces are looked up)
# tokens cut at a time: rows * width**2 cells bound the temporaries (~130 MB if every cut
# were a merge; ~20 MB for Gemma 3's vocabulary, width 31)
_CELLS_PER_CHUNK = 1 << 23
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier of the polynomial hash


def _unique(tokens: Sequence[str], priority: Sequence[float] | np.ndarray
            ) -> tuple[list[str], np.ndarray]:
    """(unique tokens in first-occurrence order, the priority of each taken at its last
    occurrence)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    prio = np.asarray(priority, np.float64)
    if prio.shape != (len(tokens),):
        raise ValueError(f"priority has shape {prio.shape}, expected ({len(tokens)},)")
    if np.isnan(prio).any():
        raise ValueError(f"priority[{int(np.flatnonzero(np.isnan(prio))[0])}] is NaN")
    uniq = list(vocab)
    last = np.fromiter(vocab.values(), np.int64, len(uniq))
    return uniq, prio[last]


def _order(prio: np.ndarray, tok: np.ndarray, cut: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Permutation of candidate merges (token ``tok``, left length ``cut``) into rank order."""
    left = cut
    right = lens[tok] - cut
    return np.lexsort((tok, -right, -left, -prio[tok]))


def _python_cuts(uniq: Sequence[str], index: dict[str, int], rows: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(token, cut, left id, right id) of every valid cut of the tokens ``rows`` (ids into uniq)."""
    tok, cut, lid, rid = [], [], [], []
    get = index.get
    for i in rows:
        t = uniq[i]
        for k in range(1, len(t)):
            a = get(t[:k])
            if a is not None:
                b = get(t[k:])
                if b is not None:
                    tok.append(i)
                    cut.append(k)
                    lid.append(a)
                    rid.append(b)
    as_arr = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
    return as_arr(tok), as_arr(cut), as_arr(lid), as_arr(rid)


def _no_cuts() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    empty = np.zeros(0, np.int64)
    return empty, empty, empty, empty


def _code_points(uniq: Sequence[str], lens: np.ndarray, rows: np.ndarray, width: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Two [len(rows), width] uint32 matrices of code point + 1 per character, zero-padded:
    one left-aligned (padding after the end), one right-aligned (padding before the start)."""
    flat = np.frombuffer("".join(uniq).encode("utf-32-le", "surrogatepass"), np.uint32)
    starts = np.cumsum(lens) - lens
    rank = np.full(len(uniq), -1, np.int64)
    rank[rows] = np.arange(len(rows))
    owner = np.repeat(np.arange(len(uniq)), lens)                  # token of each character
    keep = rank[owner] >= 0
    col = np.arange(len(flat)) - np.repeat(starts, lens)
    r, c, v = rank[owner[keep]], col[keep], flat[keep] + np.uint32(1)
    left = np.zeros((len(rows), width), np.uint32)
    left[r, c] = v
    right = np.zeros((len(rows), width), np.uint32)
    right[r, c + (width - lens[rows])[r]] = v
    return left, right


def _prefix_hashes(cp: np.ndarray) -> np.ndarray:
    """[width + 1, n] uint64: row k is the hash of the first k characters of each token.

    cp is [width, n] (one row per character position, so each step is contiguous).
    """
    h = np.zeros((cp.shape[0] + 1, cp.shape[1]), np.uint64)
    for k in range(cp.shape[0]):
        np.multiply(h[k], _BASE, out=h[k + 1])
        h[k + 1] += cp[k]
    return h


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: spreads structured keys (e.g. one-character hashes) over all bits."""
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _HashTable:
    """Open addressing (linear probing) over uint64 keys, vectorized: key -> value (values
    distinct and >= 0). ``duplicate`` is set if two keys are equal (the table is then unusable).
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray) -> None:
        bits = max(4, int(len(keys)).bit_length() + 2)            # load factor <= 1/4
        self.shift = np.uint64(64 - bits)
        self.mask = (1 << bits) - 1
        self.keys = np.zeros(1 << bits, np.uint64)
        self.values = np.full(1 << bits, -1, np.int64)
        pos = (_mix(keys) >> self.shift).astype(np.int64)
        todo = np.arange(len(keys))
        self.max_probe = 0
        while len(todo):
            taken = self.values[pos] >= 0
            # one key per free slot wins this round; the rest (and keys at taken slots) move on
            slots, first = np.unique(pos[~taken], return_index=True)
            won = np.flatnonzero(~taken)[first]
            self.keys[slots] = keys[todo[won]]
            self.values[slots] = values[todo[won]]
            lost = np.ones(len(todo), bool)
            lost[won] = False
            todo, pos = todo[lost], (pos[lost] + 1) & self.mask
            self.max_probe += 1
        # of two equal keys, a lookup finds the first one stored: the other's value is not found
        self.duplicate = not np.array_equal(self.get(keys), values)

    def get(self, q: np.ndarray) -> np.ndarray:
        """The value stored for each key of ``q``, or -1."""
        out = np.full(len(q), -1, np.int64)
        pos = (_mix(q) >> self.shift).astype(np.int64)
        todo = np.arange(len(q))
        for _ in range(self.max_probe):
            v = self.values[pos]
            found = (v >= 0) & (self.keys[pos] == q[todo])
            out[todo[found]] = v[found]
            more = (v >= 0) & ~found                               # an empty slot ends the probe
            todo, pos = todo[more], (pos[more] + 1) & self.mask
            if not len(todo):
                break
        return out


def _vector_cuts(uniq: Sequence[str], lens: np.ndarray, short: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Like ``_python_cuts`` over the ``short`` token ids, vectorized; None if two of those
    tokens share a hash (the caller then takes the Python path)."""
    width = int(lens[short].max())
    cp, cp_right = _code_points(uniq, lens, short, width)          # [n_short, width] each
    pre = _prefix_hashes(np.ascontiguousarray(cp.T))               # [width + 1, n_short]
    n_short = len(short)
    L_all = lens[short]
    full = pre[L_all, np.arange(n_short)]
    table = _HashTable(full, np.arange(n_short))
    if table.duplicate:
        return None
    powers = np.full(width + 1, _BASE, np.uint64)
    powers[0] = 1
    powers = np.multiply.accumulate(powers)                        # B**k mod 2**64
    cols = np.arange(width)

    parts = []
    step = max(1, _CELLS_PER_CHUNK // (width * width))
    for lo in range(0, n_short, step):
        rows = np.arange(lo, min(lo + step, n_short))
        L = L_all[rows]
        cut = np.arange(1, width)                                  # candidate left lengths
        k_idx, r_idx = np.nonzero(cut[:, None] < L[None, :])
        row, k = rows[r_idx], cut[k_idx]
        Lr = L[r_idx]
        left = table.get(pre[k, row])
        hit = left >= 0
        row, k, Lr, left = row[hit], k[hit], Lr[hit], left[hit]
        right = table.get(pre[Lr, row] - pre[k, row] * powers[Lr - k])
        hit = right >= 0
        row, k, Lr, left, right = row[hit], k[hit], Lr[hit], left[hit], right[hit]
        # exact check of every hash hit: lengths, then code points (the left piece against the
        # token's first k characters, left-aligned; the right piece against its last L - k,
        # right-aligned, so neither needs shifting)
        good = (L_all[left] == k) & (L_all[right] == Lr - k)
        good &= np.all((cp[left] == cp[row]) | (cols[None, :] >= k[:, None]), axis=1)
        good &= np.all((cp_right[right] == cp_right[row])
                       | (cols[None, :] < (width - (Lr - k))[:, None]), axis=1)
        parts.append((short[row[good]], k[good], short[left[good]], short[right[good]]))
    if not parts:
        return _no_cuts()
    return tuple(np.concatenate([p[j] for p in parts]).astype(np.int64) for j in range(4))


def _assemble(uniq: Sequence[str], prio: np.ndarray, lens: np.ndarray,
              cuts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
              ) -> list[tuple[str, str]]:
    tok, cut, lid, rid = (np.concatenate([c[j] for c in cuts]) for j in range(4))
    perm = _order(prio, tok, cut, lens)
    piece = uniq.__getitem__
    return list(zip(map(piece, lid[perm].tolist()), map(piece, rid[perm].tolist())))


def rebuild_merges(tokens: Sequence[str], priority: Sequence[float] | np.ndarray
                   ) -> list[tuple[str, str]]:
    """The merges implied by ``tokens``, best first (see the module docstring for the order).

    tokens: the vocabulary, id order. priority: one number per token, higher
    merges earlier (SentencePiece scores; ``-np.arange(n)`` for position order).
    """
    uniq, prio = _unique(tokens, priority)
    lens = np.fromiter(map(len, uniq), np.int64, len(uniq))
    ids = np.arange(len(uniq))
    short = ids[(lens >= 1) & (lens <= _VECTOR_MAX_LEN)]  # every piece of a cut is among these
    vec = _vector_cuts(uniq, lens, short) if len(short) else _no_cuts()
    rest = ids.tolist() if vec is None else ids[lens > _VECTOR_MAX_LEN].tolist()
    cuts = [] if vec is None else [vec]
    if rest:
        cuts.append(_python_cuts(uniq, {t: i for i, t in enumerate(uniq)}, rest))
    return _assemble(uniq, prio, lens, cuts)


def rebuild_merges_python(tokens: Sequence[str], priority: Sequence[float] | np.ndarray
                          ) -> list[tuple[str, str]]:
    """``rebuild_merges`` with every cut tested in plain Python (the reference; slow)."""
    uniq, prio = _unique(tokens, priority)
    lens = np.fromiter(map(len, uniq), np.int64, len(uniq))
    cuts = [_python_cuts(uniq, {t: i for i, t in enumerate(uniq)}, range(len(uniq)))]
    return _assemble(uniq, prio, lens, cuts)
