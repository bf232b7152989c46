"""The rows (one dict per row, ``ROW_KEYS`` always present) and the JSON + markdown output."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._gpu_common import GiB, write_json_md

# Every row carries these keys (None where they do not apply).
ROW_KEYS = ("kind", "model", "context", "batch", "cache", "status", "ms_per_token", "speedup",
            "peak_bytes", "prefill_seconds", "impl", "device")


def new_row(kind: str, device: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ROW_KEYS}
    row.update(kind=kind, device=device, **fields)
    return row


def _fmt(x: float | None, spec: str, none: str = "") -> str:
    return none if x is None else format(x, spec)


def _gib(x: int | None) -> str:
    return "" if x is None else f"{x / GiB:.1f}"


def _speedup(r: dict[str, Any]) -> str:
    return "" if r["speedup"] is None else f"{r['speedup']:.2f}x"


def time_analysis(rows: list[dict[str, Any]], copy_gbps: float) -> list[str]:
    """The 'where the time goes' markdown section, computed from the measured rows."""
    ok = [r for r in rows if r["kind"] == "decode" and r["status"] == "ok"]
    if not ok or not math.isfinite(copy_gbps) or copy_gbps <= 0:
        return []
    bw = copy_gbps * 1e9
    lines = ["## Where the time goes", "",
             f"Per decode step the model must at least read its weights once (all layer matrices and "
             f"the LM head; the embedding is a B-row gather) and its KV cache: bf16 reads every "
             f"preallocated slot (2 L B Hkv T_max d 2 bytes), PQ the K + V codes of the stored tokens "
             f"(the xla path tiles over all T_max slots) plus the fp32 codebooks. floor = bytes / "
             f"{copy_gbps:.0f} GB/s (the measured device copy bandwidth, read + write).", "",
             "| model | batch | context | cache | impl | weights GB | cache GB | floor ms | measured ms "
             "| measured / floor | beyond floor ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        w, kv = r["weight_bytes_per_step"], r["cache_read_bytes_per_step"]
        floor = 1e3 * (w + kv) / bw
        r["floor_ms"] = floor
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['cache']} | {r['impl']} | "
                     f"{w / 1e9:.2f} | {kv / 1e9:.2f} | {floor:.2f} | {r['ms_per_token']:.2f} | "
                     f"{r['ms_per_token'] / floor:.2f} | {r['ms_per_token'] - floor:.2f} |")
    fits = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault((r["model"], r["batch"], r["cache"], r["impl"]), []).append(r)
    for (model, batch, cache, impl), rs in groups.items():
        xs = np.array([r["cache_read_bytes_per_step"] for r in rs], float)
        ys = np.array([r["ms_per_token"] for r in rs], float)
        if len(rs) < 2 or np.ptp(xs) <= 0:
            continue
        slope, icpt = np.polyfit(xs, ys, 1)
        wfloor = 1e3 * rs[0]["weight_bytes_per_step"] / bw
        eff = 1e-6 / slope if slope > 0 else float("inf")  # slope: ms per byte -> GB/s
        fits.append(f"| {model} | {batch} | {cache} | {impl} | {icpt:.2f} | {wfloor:.2f} | "
                    f"{eff:.0f} | {100 * eff / copy_gbps:.0f} | {len(rs)} |")
    if fits:
        lines += ["", "Linear fit over contexts, ms/token = fixed + cache bytes / effective bandwidth "
                  "(fixed: per-step cost that does not grow with the context, to compare with the "
                  "weight-read floor):", "",
                  "| model | batch | cache | impl | fixed ms | weight floor ms | effective cache GB/s "
                  "| % of copy BW | points |", "|---|---|---|---|---|---|---|---|---|"]
        lines += fits
    notes = []
    by_key = {(r["model"], r["batch"], r["context"], r["cache"]): r for r in ok}
    for (model, batch, context, cache), r in sorted(by_key.items()):
        if cache != "pq" or (model, batch, context, "bf16") not in by_key:
            continue
        d = by_key[(model, batch, context, "bf16")]
        ideal = d["floor_ms"] / r["floor_ms"]
        notes.append(
            f"- {model}, batch {batch}, {context} tokens: bf16 {d['ms_per_token']:.2f} ms "
            f"(floor {d['floor_ms']:.2f}: weights {1e3 * d['weight_bytes_per_step'] / bw:.2f} + cache "
            f"{1e3 * d['cache_read_bytes_per_step'] / bw:.2f}), PQ[{r['impl']}] {r['ms_per_token']:.2f} ms "
            f"(floor {r['floor_ms']:.2f}); the byte floors allow {ideal:.2f}x, measured "
            f"{d['ms_per_token'] / r['ms_per_token']:.2f}x; beyond its floor PQ spends "
            f"{r['ms_per_token'] - r['floor_ms']:.2f} ms (LUT / gather / encode / merge and "
            f"layout copies) against bf16's {d['ms_per_token'] - d['floor_ms']:.2f} ms.")
    only_pq = [r for r in rows if r["kind"] == "decode" and r["cache"] == "pq" and r["status"] == "ok"
               and any(d["kind"] == "decode" and d["cache"] == "bf16" and d["status"] == "oom"
                       and (d["model"], d["batch"], d["context"]) == (r["model"], r["batch"], r["context"])
                       for d in rows)]
    for r in only_pq:
        notes.append(f"- {r['model']}, batch {r['batch']}, {r['context']} tokens: the bf16 cache does not fit; "
                     f"PQ runs at {r['ms_per_token']:.2f} ms/token in {_gib(r['peak_bytes'])} GiB.")
    if notes:
        lines += ["", *notes]
    return lines + [""]


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: str, stamp: str) -> str:
    """Write <out>/gpu_e2e_<stamp>.json (the rows) and .md; return the path without suffix."""
    copy_gbps = float(meta.get("copy_gbps", float("nan")))
    analysis = time_analysis(rows, copy_gbps)  # also sets each measured row's floor_ms
    lines = [f"# End-to-end decode: PQ KV cache vs bf16 KV cache ({meta.get('device', '?')})", "",
             f"jax {meta.get('jax')}, {meta.get('date')}, copy bandwidth {copy_gbps:.0f} GB/s (read + write), "
             f"PQ M={meta.get('M')}, nbits={meta.get('nbits')}, {meta.get('granularity')} codebooks from "
             f"{meta.get('calib_tokens')} calibration tokens ({meta.get('calib_iters')} k-means iterations), "
             f"window {meta.get('window')}, sinks {meta.get('sinks')}; random {meta.get('dtype')} weights "
             f"and dense cache (rows labelled 'bf16').", "",
             f"Timing: {meta.get('timing')}. Peak memory: {meta.get('peak_source')}. "
             f"Fill \"prefill\" = the context's random tokens run through the model (chunked, timed once; "
             f"PQ includes encoding); \"synthetic\" = the cache created holding the context "
             f"(pseudo-random K/V or codes), no prefill time.", ""]
    if meta.get("elapsed_s") is not None:
        lines += [f"Run took {meta['elapsed_s']:.0f}s (budget {meta.get('budget_s'):.0f}s).", ""]
    lines += ["| model | batch | context | cache | impl | fill | ms / token | speedup | peak GiB | "
              "prefill s | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "decode":
            continue
        sp = _speedup(r)
        status = r["status"] or ""
        if status != "ok" and r.get("error"):
            status += f": {r['error'][:90]}"
        if r.get("impl_note"):
            status += f" ({r['impl_note'][:60]})"
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['cache']} | {r['impl'] or ''} | "
                     f"{r.get('fill') or ''} | {_fmt(r['ms_per_token'], '.2f')} | {sp} | "
                     f"{_gib(r['peak_bytes'])} | {_fmt(r['prefill_seconds'], '.2f')} | {status} |")
    lines.append("")
    for r in rows:
        if r["kind"] == "model" and r.get("calib_kmeans_seconds") is not None:
            lines.append(f"- {r['model']}: weights {_gib(r['param_bytes'])} GiB (init {r['init_seconds']:.1f}s); "
                         f"codebooks {r['codebook_bytes'] / 2**20:.0f} MiB from {r['calib_source']}, k-means "
                         f"{r['calib_kmeans_seconds']:.1f}s, relative MSE K {r['calib_rel_mse_k']:.3f} / "
                         f"V {r['calib_rel_mse_v']:.3f}.")
        if r["kind"] == "kmeans":
            if r["status"] == "ok":
                lines.append(f"- k-means (million_jax.quant.pq.fit_codebooks): {r['n_vectors']} vectors, d={r['dim']}, "
                             f"M={r['M']}, nbits={r['nbits']}, {r['iters']} iterations: {r['seconds']:.2f}s "
                             f"({1e3 * r['seconds_per_iter']:.0f} ms / iteration; first call incl. compile "
                             f"{r['first_call_seconds']:.2f}s), reconstruction MSE {r['reconstruction_mse']:.4f}.")
            else:
                lines.append(f"- k-means: {r['status']} {r.get('error') or ''}")
    lines.append("")
    lines += analysis
    return write_json_md(out_dir, "gpu_e2e", stamp, rows, lines)


def print_summary(rows: list[dict[str, Any]]) -> None:
    """A short table on stdout (the device tool returns only the tail of the output)."""
    print("model        B  context cache impl   fill      ms/tok  speedup  peakGiB  prefill_s status", flush=True)
    for r in rows:
        if r["kind"] != "decode":
            continue
        sp = _speedup(r)
        print(f"{r['model']:12s} {r['batch']:<2d} {r['context']:7d} {r['cache']:5s} {str(r['impl'] or ''):6s} "
              f"{str(r.get('fill') or ''):9s} {_fmt(r['ms_per_token'], '7.2f', '      -')} {sp:>8s} "
              f"{_gib(r['peak_bytes']):>8s} {_fmt(r['prefill_seconds'], '9.2f', '        -')} "
              f"{r['status']}{'' if r['status'] == 'ok' else ' ' + str(r.get('error') or '')[:60]}", flush=True)
    for r in rows:
        if r["kind"] == "kmeans":
            print(f"k-means: {r['status']} {_fmt(r.get('seconds'), '.2f')}s "
                  f"(first call {_fmt(r.get('first_call_seconds'), '.2f')}s) {r.get('error') or ''}", flush=True)
