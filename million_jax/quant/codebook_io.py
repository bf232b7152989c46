"""Save and load PQ codebooks: safetensors tensors + JSON metadata (never pickle).

``save_kv_codebooks`` / ``load_kv_codebooks`` do this for a model's ``PQCodebooks`` (key and
value, in their fitted form, each with its own M / nbits, the granularity in the metadata, and
the optional key / value transforms float32[L, Gt, d, d] as extra tensors ``key_transform`` /
``value_transform``; their inverses are recomputed on load; residual codebooks record their
``stages`` in the metadata, 1 when absent; keys quantized before RoPE record ``key_rope: "pre"``
and their RoPE frequencies as the extra tensor ``rope_inv_freq`` float32[d/2]; ``"post"`` when
absent; norm-explicit codebooks record ``key_norms`` / ``value_norms`` / ``unit_codes`` true,
false when absent; key codes of several widths record ``key_parts`` as [[count, bits], ...], absent
or null for one width; key sub-spaces in a per-head order of RoPE pairs store it as the extra
tensor ``key_pair_order`` [L, G, M], whole numbers in float32 like every extra).

File layout: one tensor per named codebook set (e.g. ``"key"`` and ``"value"``),
each float32[*G, M, K, dsub]; the safetensors header metadata holds one entry
``"million_jax"`` with a JSON object: format version, per-tensor M/nbits/dsub
and group shape, and whatever the caller adds (model fingerprint, calibration
settings, ...). Loading checks every field against the tensors and against
what the caller expects.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from million_jax.quant.atomic_file import atomic_file
from million_jax.quant.pq import Codebooks
from million_jax.quant.kv_codebooks import PQCodebooks

FORMAT = "million-jax-codebooks"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 2 added optional extra tensors (header "extras")
_META_KEY = "million_jax"


class CodebookFileError(ValueError):
    """A codebook file is missing, corrupt, truncated or does not match what is expected."""


def save_codebooks(
    path: str | os.PathLike,
    codebooks: Mapping[str, Codebooks],
    metadata: Mapping[str, Any] | None = None,
    extras: Mapping[str, np.ndarray] | None = None,
    *,
    atomic: bool = True,
) -> None:
    """Write named codebooks, extra float32 tensors and JSON-serialisable ``metadata`` to ``path``.

    With ``atomic`` (default) the file is written next to ``path`` and renamed over it, so a
    failure leaves no partial file and an existing ``path`` intact; a replaced file keeps its
    permissions, a new one gets the umask's (``0o666 & ~umask``).
    """
    from safetensors.numpy import save_file

    if not codebooks:
        raise ValueError("save_codebooks: nothing to save")
    tensors: dict[str, np.ndarray] = {}
    entries: dict[str, Any] = {}
    for name, cb in codebooks.items():
        cb.validate()
        arr = np.ascontiguousarray(np.asarray(cb.centroids, dtype=np.float32))
        tensors[name] = arr
        entries[name] = {
            "M": cb.num_subspaces,
            "nbits": cb.nbits,
            "dsub": cb.dsub,
            "group_shape": list(cb.group_shape),
        }
    extra_shapes: dict[str, list[int]] = {}
    for name, arr in (extras or {}).items():
        if name in tensors:
            raise ValueError(f"save_codebooks: extra tensor {name!r} clashes with a codebook name")
        tensors[name] = np.ascontiguousarray(np.asarray(arr, dtype=np.float32))
        extra_shapes[name] = list(tensors[name].shape)
    header = {"format": FORMAT, "version": VERSION, "codebooks": entries, "extras": extra_shapes,
              "user": dict(metadata or {})}
    try:
        text = json.dumps(header, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"save_codebooks: metadata is not JSON-serialisable: {e}") from None
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"save_codebooks: {path} is a directory")
    if not atomic:
        save_file(tensors, path, metadata={_META_KEY: text})
        return
    with atomic_file(path) as tmp:
        save_file(tensors, tmp, metadata={_META_KEY: text})


def load_codebooks(
    path: str | os.PathLike,
    expect: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Codebooks], dict[str, Any]]:
    """(codebooks by name, user metadata) of a file of :func:`save_codebooks` (extras dropped;
    see :func:`load_codebook_file`)."""
    books, _, user = load_codebook_file(path, expect)
    return books, user


def load_codebook_file(
    path: str | os.PathLike,
    expect: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Codebooks], dict[str, np.ndarray], dict[str, Any]]:
    """Read codebooks and extra tensors written by :func:`save_codebooks`.

    Args:
      path: the .safetensors file.
      expect: optional checks. Keys ``M``, ``nbits``, ``dsub``, ``group_shape``
        are compared against every codebook; any other key is compared against
        the saved user metadata (e.g. ``{"model_fingerprint": ...}``).

    Returns:
      (codebooks by name, extra tensors by name, user metadata)
    Raises:
      CodebookFileError naming the file and the first mismatch.
    """
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    if os.path.isdir(path):
        raise CodebookFileError(f"{path} is a directory, not a codebook file; give the .safetensors file in it")
    if not os.path.isfile(path):
        raise CodebookFileError(f"codebook file not found: {path}")
    try:
        with safe_open(path, framework="numpy") as f:
            raw_meta = f.metadata() or {}
            names = list(f.keys())
            tensors = {n: f.get_tensor(n) for n in names}
    except (SafetensorError, OSError, ValueError) as e:
        raise CodebookFileError(f"{path}: not a readable safetensors file (corrupt or truncated?): {e}") from None

    if _META_KEY not in raw_meta:
        raise CodebookFileError(f"{path}: no million-jax metadata; not a codebook file written by million-jax")
    try:
        header = json.loads(raw_meta[_META_KEY])
    except json.JSONDecodeError as e:
        raise CodebookFileError(f"{path}: metadata is not valid JSON: {e}") from None
    if header.get("format") != FORMAT:
        raise CodebookFileError(f"{path}: unknown format {header.get('format')!r}")
    if header.get("version") not in READABLE_VERSIONS:
        raise CodebookFileError(f"{path}: format version {header.get('version')} (this code reads "
                                f"{', '.join(map(str, READABLE_VERSIONS))})")

    entries = header.get("codebooks", {})
    extra_shapes = header.get("extras", {})
    if set(entries) | set(extra_shapes) != set(names) or set(entries) & set(extra_shapes):
        raise CodebookFileError(f"{path}: tensors {sorted(names)} do not match metadata "
                                f"{sorted(entries) + sorted(extra_shapes)}")
    extras: dict[str, np.ndarray] = {}
    for name, shape in extra_shapes.items():
        arr = tensors.pop(name)
        if list(arr.shape) != list(shape) or arr.dtype != np.float32 or not np.isfinite(arr).all():
            raise CodebookFileError(f"{path}: extra tensor {name!r} is not finite float32{list(shape)} "
                                    f"(got {arr.dtype}{list(arr.shape)})")
        extras[name] = arr
    out: dict[str, Codebooks] = {}
    for name, arr in tensors.items():
        e = entries[name]
        want = tuple(e["group_shape"]) + (e["M"], 2 ** e["nbits"], e["dsub"])
        if arr.shape != want:
            raise CodebookFileError(f"{path}: tensor {name!r} has shape {arr.shape}, metadata says {want}")
        if arr.dtype != np.float32:
            raise CodebookFileError(f"{path}: tensor {name!r} has dtype {arr.dtype}, expected float32")
        if not np.isfinite(arr).all():
            raise CodebookFileError(f"{path}: tensor {name!r} contains NaN/Inf")
        for field in ("M", "nbits", "dsub", "group_shape"):
            if expect and field in expect:
                got = list(e[field]) if field == "group_shape" else e[field]
                exp = list(expect[field]) if field == "group_shape" else expect[field]
                if got != exp:
                    raise CodebookFileError(
                        f"{path}: codebook {name!r} has {field}={got}, expected {exp}"
                    )
        out[name] = Codebooks(centroids=arr)
    user = header.get("user", {})
    for field, exp in (expect or {}).items():
        if field in ("M", "nbits", "dsub", "group_shape"):
            continue
        if user.get(field) != exp:
            raise CodebookFileError(
                f"{path}: metadata {field}={user.get(field)!r} does not match expected {exp!r}"
            )
    return out, extras, user


_KV_EXTRAS = ("key_transform", "value_transform", "rope_inv_freq", "key_pair_order")
KEY_ROPE = ("post", "pre")


def save_kv_codebooks(path: str | os.PathLike, books: PQCodebooks,
                      metadata: Mapping[str, Any] | None = None, *, atomic: bool = True) -> None:
    """Write a model's key/value codebooks in their fitted form, granularity recorded."""
    key, value = books.compact()
    meta = dict(metadata or {})
    meta.update(granularity=books.granularity, n_layers=books.num_layers, stages=books.stages,
                head_dim=books.head_dim, key_rope=books.key_rope, key_norms=books.key_norms,
                value_norms=books.value_norms, unit_codes=books.unit_codes,
                key_parts=None if books.key_parts is None else [list(p) for p in books.key_parts])
    extras = {name: np.asarray(getattr(books, name), np.float32) for name in _KV_EXTRAS
              if getattr(books, name) is not None}
    save_codebooks(path, {"key": key, "value": value}, meta, extras, atomic=atomic)


def load_kv_codebooks(path: str | os.PathLike, expect: Mapping[str, Any] | None = None,
                      ) -> tuple[PQCodebooks, dict[str, Any]]:
    """Read a file of :func:`save_kv_codebooks` as PQCodebooks laid out per layer.

    ``expect`` as for :func:`load_codebooks`. Raises CodebookFileError on any mismatch.
    """
    tensors, extras, meta = load_codebook_file(path, expect)
    if set(tensors) != {"key", "value"}:
        raise CodebookFileError(f"{os.fspath(path)}: expected 'key' and 'value' codebooks, found {sorted(tensors)}")
    if set(extras) - set(_KV_EXTRAS):
        raise CodebookFileError(f"{os.fspath(path)}: unknown extra tensors {sorted(set(extras) - set(_KV_EXTRAS))}")
    try:
        books = PQCodebooks.from_centroids(tensors["key"].centroids, tensors["value"].centroids,
                                           meta.get("granularity"), num_layers=meta.get("n_layers"),
                                           stages=meta.get("stages", 1))
        head_dim = meta.get("head_dim")  # older files lack it
        if head_dim is not None and head_dim != books.head_dim:
            raise ValueError(f"the metadata and the tensors disagree: head_dim {head_dim} recorded, but the key "
                             f"tensor read as {books.stages} residual stage(s) (metadata stages={meta.get('stages', 1)!r}) "
                             f"gives head_dim {books.head_dim} (edited or corrupt file)")
        books = books.with_transforms(extras.get("key_transform"), extras.get("value_transform"))
        key_rope = meta.get("key_rope", "post")
        if key_rope not in KEY_ROPE:
            raise ValueError(f"key_rope={key_rope!r} in the metadata (one of {KEY_ROPE})")
        if (key_rope == "pre") != ("rope_inv_freq" in extras):
            raise ValueError(f"key_rope={key_rope!r} but the file {'lacks' if key_rope == 'pre' else 'has'} "
                             "the rope_inv_freq tensor")
        if key_rope == "pre":
            books = books.with_pre_rope_keys(extras["rope_inv_freq"])
        norms = {name: meta.get(name, False) for name in ("key_norms", "value_norms", "unit_codes")}
        for name, x in norms.items():
            if not isinstance(x, bool):
                raise ValueError(f"{name}={x!r} in the metadata (true or false)")
        books = books.with_explicit_norms(norms["key_norms"], norms["value_norms"], norms["unit_codes"])
        parts = meta.get("key_parts")
        if parts is not None:
            if not isinstance(parts, list) or not all(
                    isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in parts):
                raise ValueError(f"key_parts={parts!r} in the metadata ([[count, bits], ...] of ints, or null)")
            books = books.with_key_parts(tuple(tuple(p) for p in parts))
        if "key_pair_order" in extras:
            order = extras["key_pair_order"]
            if not np.array_equal(order, np.round(order)):
                raise ValueError("the key_pair_order tensor holds non-integer pair indices")
            books = books.with_key_pair_order(order.astype(np.int32))
    except ValueError as e:
        raise CodebookFileError(f"{os.fspath(path)}: {e}") from None
    return books, meta
