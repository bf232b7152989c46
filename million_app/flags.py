"""Flag checks and conversions shared by the subcommands (the leaf helpers of the CLI).

The command modules (:mod:`million_app.commands`) and the modules they drive import
these; this module imports none of them, so the application layer's imports stay a DAG.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import jax

from million_app.caches import DTYPES
from million_app.calibrate import load_model_codebooks
from million_app.corpus import read_text
from million_app.errors import UsageError
from million_jax.cache.spec import CacheSpec
from million_jax.calibration.fit import check_max_vectors
from million_jax.quant.pq import check_nbits
from models import ContextLengthError, LoadedModel, check_context


def load_text(spec: str, flag: str, args: argparse.Namespace | None = None) -> str:
    """read_text (with ``args.encoding`` / ``args.errors``); missing, empty, binary or
    undecodable files are UsageErrors naming the flag."""
    encoding = getattr(args, "encoding", None) or "utf-8"
    errors = getattr(args, "errors", None) or "strict"
    try:
        return read_text(spec, encoding, errors)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: {e}") from None


def check_codebook_settings(nbits: int, max_vectors: int) -> None:
    """The library's checks of --nbits (:func:`million_jax.quant.pq.check_nbits`) and of
    --max-vectors against its 2**nbits centroids (:func:`million_jax.calibration.fit.check_max_vectors`),
    before any model is loaded; their ValueError as a UsageError naming the flags."""
    try:
        check_nbits(nbits)
        check_max_vectors(max_vectors, nbits)
    except ValueError as e:
        raise UsageError(f"--nbits {nbits} / --max-vectors {max_vectors}: {e}") from None


def check_positions(model: LoadedModel, n: int, what: str) -> None:
    """UsageError if ``what`` needs more than the model's context (``models.check_context``)."""
    try:
        check_context(model.config, n, what)
    except ContextLengthError as e:
        raise UsageError(f"{e} (it was not trained that far)") from None


def available_memory() -> int | None:
    """Bytes free for a new allocation: the accelerator's, else the host's (None if unknown)."""
    if jax.default_backend() != "cpu":
        try:
            st = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" in st:
                return int(st["bytes_limit"]) - int(st.get("bytes_in_use", 0))
        except Exception:  # noqa: BLE001 - memory stats are optional per backend
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_positive(**values: int | None) -> None:
    """UsageError for the first flag that is set and < 1."""
    for name, v in values.items():
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def cache_spec(args: argparse.Namespace, model: LoadedModel) -> tuple[CacheSpec, dict[str, Any]]:
    """The library CacheSpec of the cache flags, and where its codebooks came from.

    Returns (spec, source): source is ``{"codebooks": path, "calib_window": n or None}`` when
    --codebooks is given (what the commands report and warn about), else ``{}``; a pq spec's
    ``precise_sinks`` come from --precise-sinks, else from the codebook file's metadata. Flags that do
    not apply to the chosen --cache are refused here; the settings themselves are checked by
    CacheSpec, whose ValueError becomes one UsageError line naming the flags.
    """
    protocol = args.protocol or args.default_protocol
    quantized = args.cache != "dense"
    if not quantized:
        given = [f for f, v in (("--protocol", args.protocol), ("--recent", args.recent),
                                ("--sinks", args.sinks)) if v is not None]
        if given:
            raise UsageError(f"{'/'.join(given)} only apply to quantized caches (--cache pq, uniform, "
                             "turboquant or kivi); a dense cache is exact")
    if protocol == "all" and (args.recent is not None or args.sinks is not None):
        raise UsageError("--recent/--sinks keep tokens exact, which only --protocol realistic "
                         "does (--protocol all quantizes every token)")
    if args.cache not in ("uniform", "kivi") and args.group_size is not None:
        raise UsageError("--group-size is a setting of --cache uniform or kivi")
    if args.cache != "uniform" and args.uniform_mode is not None:
        raise UsageError("--uniform-mode is a setting of --cache uniform")
    qjl, rotation_seed = getattr(args, "qjl", False), getattr(args, "rotation_seed", None)
    if args.cache != "turboquant" and (qjl or rotation_seed is not None):
        raise UsageError("--qjl/--rotation-seed are settings of --cache turboquant")
    if args.cache == "kivi" and args.sinks:
        raise UsageError("--cache kivi keeps no exact first tokens (--sinks); its exact tokens are the --recent R")
    if args.uniform_mode == "token" and args.group_size is not None:
        raise UsageError("--group-size applies to --uniform-mode kivi (token mode has one "
                         "scale per token)")
    if args.cache in ("uniform", "kivi") and args.bits is None:
        raise UsageError(f"--cache {args.cache} needs --bits (2, 4 or 8 bits per stored element)")
    if args.cache == "turboquant" and args.bits is None:
        raise UsageError("--cache turboquant needs --bits (bits per coordinate: 2, 2.5, 3, 3.5, 4, ...)")
    if args.cache not in ("uniform", "kivi", "turboquant") and args.bits is not None:
        raise UsageError(f"--bits is a setting of --cache uniform, kivi or turboquant (--cache {args.cache} "
                         "takes its budget from its codebooks)" if args.cache == "pq" else
                         f"--bits is a setting of --cache uniform, kivi or turboquant, not of --cache {args.cache}")
    precise = getattr(args, "precise_sinks", None)
    if precise is not None and args.cache != "pq":
        raise UsageError("--precise-sinks is a setting of --cache pq")
    if precise is not None and precise < 0:
        raise UsageError(f"--precise-sinks must be >= 0, got {precise}")
    if args.cache == "pq" and args.codebooks is None:
        raise UsageError("--cache pq needs --codebooks FILE (make one with `million-jax calibrate`)")
    flags = " ".join(f"{flag} {val}" for flag, val in (
        ("--cache", args.cache), ("--bits", args.bits), ("--group-size", args.group_size),
        ("--uniform-mode", args.uniform_mode), ("--protocol", args.protocol), ("--recent", args.recent),
        ("--sinks", args.sinks), ("--codebooks", args.codebooks), ("--qjl", True if qjl else None),
        ("--rotation-seed", rotation_seed), ("--precise-sinks", precise)) if val is not None)
    kw: dict[str, Any] = dict(
        kind=args.cache, dtype=DTYPES[args.cache_dtype], bits=args.bits,
        quantize_all=quantized and protocol == "all",
        window=(128 if args.cache == "kivi" else 64) if args.recent is None and quantized else (args.recent or 0),
        sinks=args.sinks or 0)
    if args.cache == "turboquant":
        kw.update(qjl=bool(qjl), seed=0 if rotation_seed is None else rotation_seed)
    if args.group_size is not None:
        kw["group_size"] = args.group_size
    if args.uniform_mode is not None:
        kw["uniform_mode"] = args.uniform_mode
    try:
        spec = CacheSpec(**kw)
    except ValueError as e:
        raise UsageError(f"{flags}: {e}") from None
    if args.codebooks is None:
        return spec, {}
    books, meta = load_model_codebooks(args.codebooks, model)
    if precise is None:  # the codebook file's measured choice (calibrate --bits B records it)
        n = meta.get("precise_sinks", 0)
        precise = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0
    try:
        spec = dataclasses.replace(spec, codebooks=books, precise_sinks=precise)
    except ValueError as e:
        raise UsageError(f"{flags}: {e}") from None
    w = meta.get("calib_window")
    calib_window = w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None
    return spec, {"codebooks": args.codebooks, "calib_window": calib_window}
