"""``million-jax sweep``: dense vs PQ vs uniform on one model, as a table, JSON and a plot.

The grid (d = the model's head_dim; M = d / dsub):

    dense                          the reference
    PQ  dsub=2, 8 bit  (4 b/elem)  shared, layer and layer_head codebooks (granularity)
    PQ  dsub=1, 4 bit  (4 b/elem)  per-channel 16-level codebooks, layer_head
    PQ  dsub=2, 6 bit  (3 b/elem)  layer_head
    PQ  dsub=2, 4 bit  (2 b/elem)  layer_head
    PQ  dsub=4, 8 bit  (2 b/elem)  layer_head
    uniform KIVI-style int2, int4 (group min(32, d)), per-token int4

Calibration K/V are collected once from the calibration text and every PQ codebook is
fitted from the same samples (``max_vectors`` per k-means problem, ``iters`` iterations).
Results are written after every configuration (``results.json``, ``results.md``) and the
plot (``ppl_vs_bits.png``) at the end. Rerun into a folder that holds results (``staged``,
the command's ``--force``), the new ones are written under ``*.partial.*`` names and moved
over the old ones only when the whole grid has run: an interrupted rerun leaves the finished
results (and their plot and codebooks) as they were.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from million_app import progress
from million_app.caches import DTYPES
from million_jax.cache.spec import CacheSpec
from million_app.calibrate import (calibration_kv, codebook_metadata, fit_model_codebooks, kmeans_problem_summary,
                                   model_fingerprint, save_model_codebooks)
from million_app.corpus import text_hash
from million_app.loading import model_name, tokenize
from million_app.perplexity import eval_windows, evaluate
from million_app.report import environment, human_bytes, write_json, write_text

# (dsub, nbits, granularity)
PQ_GRID: tuple[tuple[int, int, str], ...] = (
    (2, 8, "shared"), (2, 8, "layer"), (2, 8, "layer_head"),
    (1, 4, "layer_head"), (2, 6, "layer_head"), (2, 4, "layer_head"), (4, 8, "layer_head"),
)
# what a sweep writes into its folder (codebooks: CODEBOOK_DIR/*.safetensors with --save-codebooks)
RESULT_FILES = ("results.json", "results.md", "ppl_vs_bits.png")
CODEBOOK_DIR = "codebooks"
# (mode, bits)
UNIFORM_GRID: tuple[tuple[str, int], ...] = (("kivi", 2), ("kivi", 4), ("token", 4))


@dataclasses.dataclass
class SweepSettings:
    """Everything that shapes a sweep (recorded in results.json)."""

    calib: str
    text: str
    calib_tokens: int = 16384
    max_tokens: int = 8192
    window: int = 512
    batch: int = 4
    iters: int = 10
    max_vectors: int = 8192
    seed: int = 0
    protocol: str = "all"
    recent: int = 64
    sinks: int = 0
    cache_dtype: str = "bfloat16"
    bos: bool = False


def _spec(s: SweepSettings, **kw: Any) -> CacheSpec:
    return CacheSpec(quantize_all=s.protocol == "all", window=s.recent, sinks=s.sinks, dtype=DTYPES[s.cache_dtype], **kw)


def pq_grid(head_dim: int) -> list[tuple[int, int, str]]:
    """(M, nbits, granularity) of the PQ grid for this head_dim (entries that do not fit dropped)."""
    return [(head_dim // ds, nb, g) for ds, nb, g in PQ_GRID if head_dim % ds == 0]


def row_of(name: str, r: dict, dense_ppl: float | None) -> dict:
    """A compact table row from an eval result."""
    row = {"name": name, "cache": r["cache"], "label": r["cache_label"],
           "bits_per_element": r["bits_per_element"], "storage_bits_per_element": r["storage_bits_per_element"],
           "ppl": r["ppl"], "nll": r["nll"], "tokens": r["tokens"],
           "cache_bytes": r["cache_bytes"], "dense_cache_bytes": r["dense_cache_bytes"],
           "codebook_bytes": r["codebook_bytes"], "eval_seconds": r["seconds"]}
    if dense_ppl:
        row["ppl_increase_pct"] = 100.0 * (r["ppl"] / dense_ppl - 1.0)
    return row


def markdown_table(rows: list[dict], window: int, dense_dtype: str) -> str:
    """The results as a markdown table (one row per configuration)."""
    head = (f"| cache | bits/elem | ppl | vs dense | cache bytes (one {window}-token sequence) "
            f"| vs {dense_dtype} dense | codebooks |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        delta = "" if r["cache"] == "dense" else f"{r.get('ppl_increase_pct', float('nan')):+.1f}%"
        ratio = r["dense_cache_bytes"] / max(r["cache_bytes"], 1)
        vs = f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"
        bits = f"{r['bits_per_element']:.2f}"
        if r["storage_bits_per_element"] != r["bits_per_element"]:
            bits += f" ({r['storage_bits_per_element']:.0f} stored)"
        books = human_bytes(r["codebook_bytes"]) if r["codebook_bytes"] else "-"
        lines.append(f"| {r['label']} | {bits} | {r['ppl']:.3f} | {delta} | "
                     f"{human_bytes(r['cache_bytes'])} | {vs} | {books} |")
    return head + "\n".join(lines) + "\n"


def _label_positions(points: list[tuple[float, float]], gap: float = 1.05) -> list[float]:
    """Text heights for labels at (x, y) points: labels sharing an x are pushed apart (log scale)."""
    ys = [y for _, y in points]
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    last: dict[float, float] = {}
    for i in order:
        x, y = points[i]
        ys[i] = max(y, last.get(x, 0.0) * gap)
        last[x] = ys[i]
    return ys


def plot(rows: list[dict], path: str, title: str) -> None:
    """PNG of perplexity (log scale) against bits per element (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120, layout="constrained")
    styles = {"shared": ("tab:red", "v"), "layer": ("tab:orange", "s"),
              "layer_head": ("tab:blue", "o"), "uniform": ("tab:green", "^")}
    legends = {"shared": "PQ, one shared codebook", "layer": "PQ, per-layer codebooks",
               "layer_head": "PQ, per-layer-per-head codebooks",
               "uniform": "uniform (KIVI-style / per-token)"}
    quant = [r for r in rows if r["cache"] != "dense"]
    text_y = _label_positions([(r["bits_per_element"], r["ppl"]) for r in quant])
    seen = set()
    for r, ty in zip(quant, text_y):
        key = r["granularity"] if r["cache"] == "pq" else "uniform"
        color, marker = styles[key]
        ax.scatter(r["bits_per_element"], r["ppl"], color=color, marker=marker, s=40,
                   label=None if key in seen else legends[key], zorder=3)
        seen.add(key)
        short = r["label"].replace("uniform ", "").replace(" layer_head", "")
        ax.annotate(short, (r["bits_per_element"], r["ppl"]), xytext=(r["bits_per_element"] + 0.06, ty),
                    textcoords="data", fontsize=7, va="center",
                    arrowprops=dict(arrowstyle="-", lw=0.4, color="0.6") if ty != r["ppl"] else None)
    for r in rows:
        if r["cache"] == "dense":
            ax.axhline(r["ppl"], color="k", ls="--", lw=1)
            ax.annotate(f"{r['label']} ({r['bits_per_element']:.0f} b/elem): {r['ppl']:.3f}",
                        (0.01, r["ppl"]), xycoords=("axes fraction", "data"), va="top",
                        fontsize=8)
    ax.set_yscale("log")
    ppls = [r["ppl"] for r in rows]
    nice = [m * 10.0 ** e for e in range(-1, 6) for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8)]
    ax.set_yticks([t for t in nice if min(ppls) / 1.1 <= t <= max(ppls) * 1.1] or [min(ppls)])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    xs = [r["bits_per_element"] for r in quant] or [0.0]
    ax.set_xlim(min(xs) - 0.3, max(xs) + 0.9)
    ax.set_xlabel("bits per K/V element (codes + scales; PQ codebooks excluded)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper right")
    fig.savefig(path)
    plt.close(fig)


def plot_title(results: dict) -> str:
    """The plot title: model, evaluation and calibration settings."""
    s = results["settings"]
    used = results.get("calib_tokens_used", s["calib_tokens"])
    return (f"{results['model']}: perplexity vs KV-cache bits per element\n"
            f"eval: {s['max_tokens']} tokens of {s['text']}, window {s['window']}, protocol "
            f"{s['protocol']}; codebooks: {used} tokens of {s['calib']}")


def rewrite(out_dir: str) -> None:
    """Regenerate results.md and ppl_vs_bits.png from an existing results.json."""
    import json

    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    write_outputs(results, out_dir)
    plot(results["rows"], os.path.join(out_dir, "ppl_vs_bits.png"), plot_title(results))


def existing_outputs(out_dir: str) -> list[str]:
    """The files of an earlier sweep in ``out_dir`` (results, plot, saved codebooks)."""
    found = [n for n in RESULT_FILES if os.path.lexists(os.path.join(out_dir, n))]
    books = os.path.join(out_dir, CODEBOOK_DIR)
    if os.path.isdir(books):
        found += sorted(os.path.join(CODEBOOK_DIR, n) for n in os.listdir(books) if n.endswith(".safetensors"))
    return found


def partial_name(name: str) -> str:
    """'results.json' -> 'results.partial.json' (where a staged sweep writes until it completes)."""
    stem, ext = os.path.splitext(name)
    return f"{stem}.partial{ext}"


def run_sweep(model: Any, calib_text: str, eval_text: str, s: SweepSettings, out_dir: str,
              save_codebooks: bool = False, staged: bool = False) -> dict:
    """Run the whole grid; returns (and writes) the results dict.

    ``staged``: write under :func:`partial_name` names and move them over the final names
    only once the grid is complete (module docstring); a stale plot goes only then.
    """
    cfg = model.config
    d = cfg.head_dim
    eval_ids = tokenize(model, eval_text, bos=s.bos)
    eval_windows(eval_ids, s.window, s.max_tokens)  # fail early on a too-short text
    calib_ids = tokenize(model, calib_text)
    os.makedirs(out_dir, exist_ok=True)
    results: dict[str, Any] = {
        "model": model_name(model), "model_fingerprint": model_fingerprint(model),
        "settings": dataclasses.asdict(s), "calib_text_hash": text_hash(calib_text),
        "eval_text_hash": text_hash(eval_text), "environment": environment(), "rows": [],
        "details": []}
    t_start = time.perf_counter()

    def record(name: str, r: dict, extra: dict | None = None) -> None:
        dense = results["rows"][0]["ppl"] if results["rows"] else None
        row = row_of(name, r, dense)
        row.update(extra or {})
        results["rows"].append(row)
        results["details"].append(r)
        results["total_seconds"] = time.perf_counter() - t_start
        write_outputs(results, out_dir, partial=staged)
        progress.status(f"[{len(results['rows'])}] {row['label']}: ppl {row['ppl']:.3f}, "
                        f"{row['bits_per_element']:.2f} bits/elem")

    ev = dict(window=s.window, max_tokens=s.max_tokens, batch=s.batch)
    record("dense", evaluate(model, eval_ids, _spec(s, kind="dense"), **ev))
    g = min(32, d)
    for mode, bits in UNIFORM_GRID:
        spec = _spec(s, kind="uniform", bits=bits, uniform_mode=mode, group_size=g)
        record(f"uniform-{mode}-int{bits}", evaluate(model, eval_ids, spec, **ev),
               {"uniform_mode": mode, "bits": bits})

    k, v, used = calibration_kv(model, calib_ids, tokens=s.calib_tokens, window=s.window,
                                batch=s.batch)
    results["calib_tokens_used"] = used
    moves: list[str] = []  # out_dir-relative final names of staged files
    for M, nbits, gran in pq_grid(d):
        progress.status("k-means: " + kmeans_problem_summary(k.shape, M, nbits, gran, s.max_vectors))
        t0 = time.perf_counter()
        books = fit_model_codebooks(k, v, M=M, nbits=nbits, granularity=gran, seed=s.seed,
                                    iters=s.iters, max_vectors=s.max_vectors)
        fit_s = time.perf_counter() - t0
        recorded = None
        if save_codebooks:
            os.makedirs(os.path.join(out_dir, CODEBOOK_DIR), exist_ok=True)
            name = os.path.join(CODEBOOK_DIR, f"pq_M{M}_b{nbits}_{gran}.safetensors")
            path = os.path.join(out_dir, partial_name(name) if staged else name)
            moves.append(name)
            recorded = os.path.join(out_dir, name)  # where it is once the sweep completes
            meta = codebook_metadata(model, books, calib_text=s.calib, calib_tokens=used,
                                     calib_text_hash=text_hash(calib_text), seed=s.seed,
                                     iters=s.iters, max_vectors=s.max_vectors)
            save_model_codebooks(path, books, meta, force=True)
        r = evaluate(model, eval_ids, _spec(s, kind="pq", codebooks=books), **ev)
        r["codebooks"] = recorded
        record(f"pq-M{M}-b{nbits}-{gran}", r, {"M": M, "nbits": nbits, "granularity": gran, "fit_seconds": fit_s})
    png = "ppl_vs_bits.png"
    plot(results["rows"], os.path.join(out_dir, partial_name(png) if staged else png), plot_title(results))
    if staged:  # the grid is complete: the new results replace the old ones now
        for name in moves + list(RESULT_FILES):
            os.replace(os.path.join(out_dir, partial_name(name)), os.path.join(out_dir, name))
    return results


def write_outputs(results: dict, out_dir: str, partial: bool = False) -> None:
    """results.json and results.md (rewritten after every configuration; ``partial``: under
    :func:`partial_name` names)."""
    name = partial_name if partial else (lambda n: n)
    write_json(os.path.join(out_dir, name("results.json")), results, "--out", force=True)
    s = results["settings"]
    md = markdown_table(results["rows"], s["window"], s["cache_dtype"])
    write_text(os.path.join(out_dir, name("results.md")),
               f"# Sweep: {results['model']}\n\n"
               f"Evaluation: first {s['max_tokens']} tokens of `{s['text']}`, windows of "
                f"{s['window']}, protocol `{s['protocol']}`. Calibration: "
                f"{results.get('calib_tokens_used', s['calib_tokens'])} tokens of `{s['calib']}`, "
                f"k-means {s['iters']} iterations, at most {s['max_vectors']} vectors per "
               f"problem.\n\n" + md, "--out", force=True)
