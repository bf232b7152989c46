"""The frontier (issue 34): perplexity against stored bits/elem for dense, pq, turboquant and KIVI.

Every row is one ``million-jax eval`` command (printed before it runs, recorded in the JSON it
writes); rows whose JSON exists are skipped, so an interrupted run resumes. PQ rows need the
``calibrate --bits B --seed S`` files in ``--codebooks-dir`` (``pq{B}_s{S}.safetensors``; rows
without their file are skipped with a note).

    PYTHONPATH=. python benchmarks/frontier.py --out benchmarks/results/frontier \\
        --codebooks-dir /tmp/fr --protocol all --max-tokens 4096
    PYTHONPATH=. python benchmarks/frontier.py --table     # results.md + frontier.png from the JSONs

    # Gemma 3 270M (its 3 global layers take the cache, the 15 sliding layers keep exact 512-token
    # rings; each 512-token window starts with BOS, as the model's tokenizer adds one):
    PYTHONPATH=. python benchmarks/frontier.py --model gemma3-270m --out benchmarks/results/frontier/gemma3 \
        --codebooks-dir /tmp/g3fr --protocol all --calibrate
    PYTHONPATH=. python benchmarks/frontier.py --model gemma3-270m --out benchmarks/results/frontier/gemma3 --table

``--calibrate`` first makes the missing ``pq{B}_s{S}.safetensors`` with the model's calibration
flags (``MODELS``: SmolLM2 the ``calibrate`` defaults, Gemma 3 the flags of
``benchmarks/results/gemma3_270m/run.sh``: 8192 tokens, keys before RoPE), its wall time in
``calibrate_pq{B}_s{S}.json`` beside the rows. Each row's JSON also gets ``wall_s`` (the whole
command, model load included).

Protocols: ``all`` (every key/value from codes; KIVI then has no exact recent tokens and each
query reads its own key group with the group's prefix statistics) and ``realistic`` (pq and
turboquant: 4 exact sinks + 64 exact recent tokens; KIVI: its own R recent tokens, no sinks).
"""
from __future__ import annotations

import argparse
import glob
import re
import json
import os
import shlex
import subprocess
import sys
import time

CLI = [sys.executable, "-m", "million_app"]

# name -> eval flags (without --protocol / recent flags)
TURBO = [2, 2.5, 3, 3.5, 4, 5, 8]
TURBO_QJL = [3, 4]
KIVI_ALL = [(2, 32), (2, 128), (4, 32), (4, 128), (8, 128)]
KIVI_REALISTIC = [(2, 32, 32), (2, 32, 128), (2, 128, 128), (4, 32, 32), (4, 32, 128), (4, 128, 128)]
PQ_BITS = [2, 3, 4]
SEEDS = [0, 1]

# per model: plot label, whether the turboquant+qjl rows run by default, the calibrate flags of the
# pq rows (besides --model --text builtin:calib --bits --seed --out) and the plot's y range (x dense)
MODELS = {
    "smollm2": {"label": "SmolLM2-135M", "qjl": True, "calibrate": [], "ylim": {"all": 1.6, "realistic": 1.15}},
    "gemma3-270m": {"label": "Gemma 3 270M", "qjl": False,
                    "calibrate": ["--tokens", "8192", "--rope", "pre"], "ylim": {"all": 2.0, "realistic": 1.6}},
}


def model_preset(model: str) -> dict:
    return MODELS.get(model, {"label": model, "qjl": True, "calibrate": [], "ylim": {"all": 1.6, "realistic": 1.15}})


def rows(protocol: str, books_dir: str, qjl: bool = True) -> list[tuple[str, list[str]]]:
    out = []
    if protocol == "all":
        out.append(("dense", ["--cache", "dense"]))
    extra = ["--protocol", protocol] + (["--sinks", "4", "--recent", "64"] if protocol == "realistic" else [])
    for b in PQ_BITS:
        # "n": norm-explicit codebooks (pq{B}n_s{S}.safetensors), "nu": norm-explicit codebooks of unit
        # vectors (NEQ); "g2", "g2n", "g2nu": keys before RoPE in sub-spaces of two RoPE pairs
        # (pq2-pre-g2 and its norm variants); skipped when absent
        for variant in ("", "n", "nu", "g2", "g2n", "g2nu"):
            for s in SEEDS:
                name = f"pq{b}{variant}_s{s}"
                out.append((name, ["--cache", "pq", "--codebooks", os.path.join(books_dir, f"{name}.safetensors")]
                            + extra))
    for b in TURBO:
        out.append((f"turboquant{b:g}", ["--cache", "turboquant", "--bits", f"{b:g}"] + extra))
    for b in TURBO_QJL if qjl else []:
        out.append((f"turboquant{b:g}_qjl", ["--cache", "turboquant", "--bits", f"{b:g}", "--qjl"] + extra))
    if protocol == "all":
        for b, g in KIVI_ALL:
            out.append((f"kivi{b}_g{g}", ["--cache", "kivi", "--bits", str(b), "--group-size", str(g),
                                          "--protocol", "all"]))
    else:
        for b, g, r in KIVI_REALISTIC:
            out.append((f"kivi{b}_g{g}_r{r}", ["--cache", "kivi", "--bits", str(b), "--group-size", str(g),
                                               "--protocol", "realistic", "--recent", str(r)]))
    return out


def calibrate(args) -> None:
    """The missing pq codebook files of the rows, one ``million-jax calibrate`` each."""
    os.makedirs(args.codebooks_dir, exist_ok=True)
    for b in PQ_BITS:
        for s in SEEDS:
            out = os.path.join(args.codebooks_dir, f"pq{b}_s{s}.safetensors")
            if os.path.exists(out):
                continue
            cmd = CLI + ["calibrate", "--model", args.model, "--text", "builtin:calib"] \
                + model_preset(args.model)["calibrate"] + ["--bits", str(b), "--seed", str(s), "--out", out]
            print(f"[calibrate] pq{b}_s{s}: {shlex.join(cmd[2:])}", flush=True)
            t0 = time.time()
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                print(f"  FAILED ({res.returncode}): {res.stderr[-2000:]}", flush=True)
                continue
            wall = time.time() - t0
            with open(os.path.join(args.out, f"calibrate_pq{b}_s{s}.json"), "w") as f:
                json.dump({"command": "million-jax " + shlex.join(cmd[3:]), "wall_s": round(wall, 1)}, f, indent=1)
            print(f"  {wall:.0f} s", flush=True)


def run(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    qjl = model_preset(args.model)["qjl"] if args.qjl is None else args.qjl
    if args.calibrate:
        calibrate(args)
    for protocol in args.protocol.split(","):
        todo = rows(protocol, args.codebooks_dir, qjl)
        for i, (name, flags) in enumerate(todo):
            if only and name not in only:
                continue
            path = os.path.join(args.out, f"{protocol}_{name}.json")
            if os.path.exists(path):
                continue
            if "--codebooks" in flags and not os.path.exists(flags[flags.index("--codebooks") + 1]):
                print(f"[{protocol} {i + 1}/{len(todo)}] {name}: no codebooks, skipped", flush=True)
                continue
            cmd = CLI + ["eval", "--model", args.model, "--text", args.text, "--max-tokens", str(args.max_tokens),
                         "--window", str(args.window), "--batch", "4", "--quiet", "--json", path] + flags
            print(f"[{protocol} {i + 1}/{len(todo)}] {name}: {shlex.join(cmd[2:])}", flush=True)
            t0 = time.time()
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                print(f"  FAILED ({res.returncode}): {res.stderr[-2000:]}", flush=True)
                continue
            with open(path) as f:
                r = json.load(f)
            r["command"] = "million-jax " + shlex.join(cmd[3:])
            r["wall_s"] = round(time.time() - t0, 1)
            with open(path, "w") as f:
                json.dump(r, f, indent=1)
            print(f"  ppl {r['ppl']:.4f}, {r['storage_bits_per_element']:.3f} b/elem stored ({time.time() - t0:.0f} s)",
                  flush=True)


def family(name: str) -> str:
    if re.match(r"pq\d+g2(n|nu)?_", name):
        return "pq+g2"
    if re.match(r"pq\d+nu_", name):
        return "pq+unit"
    if re.match(r"pq\d+n_", name):
        return "pq+norms"
    for f in ("dense", "pq", "turboquant", "kivi"):
        if name.startswith(f):
            return f + ("+qjl" if name.endswith("_qjl") else "")
    return name


def table(args) -> None:
    res = {}
    for path in sorted(glob.glob(os.path.join(args.out, "all_*.json")) + glob.glob(os.path.join(args.out, "realistic_*.json"))):
        base = os.path.basename(path)[:-5]
        protocol, name = base.split("_", 1)
        with open(path) as f:
            res[(protocol, name)] = json.load(f)
    dense = res.get(("all", "dense"))
    lines = ["| protocol | cache | stored bits/elem | ppl | vs dense |", "|---|---|---|---|---|"]
    for (protocol, name), r in sorted(res.items(), key=lambda kv: (kv[0][0], family(kv[0][1]),
                                                                   kv[1]["storage_bits_per_element"], kv[0][1])):
        rel = f"{100 * (r['ppl'] / dense['ppl'] - 1):+.1f}%" if dense and name != "dense" else ""
        lines.append(f"| {protocol} | {name} ({r['cache_label']}) | {r['storage_bits_per_element']:.3f} | "
                     f"{r['ppl']:.3f} | {rel} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)
    plot(res, dense, os.path.join(args.out, "frontier.png"), model_preset(args.model), args.text)


def plot(res, dense, path, preset=None, text: str = "builtin:eval") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preset = preset or model_preset("smollm2")

    protocols = [p for p in ("all", "realistic") if any(q == p for q, _ in res)] or ["all"]  # panels with rows
    fig, axes = plt.subplots(1, len(protocols), figsize=(6.5 * len(protocols), 5), sharey=False, squeeze=False)
    axes = axes[0]
    style = {"pq": ("tab:blue", "o"), "pq+norms": ("tab:purple", "D"), "pq+unit": ("tab:brown", "P"),
             "pq+g2": ("tab:cyan", "*"), "turboquant": ("tab:orange", "s"), "turboquant+qjl": ("tab:red", "x"),
             "kivi": ("tab:green", "^")}
    for ax, protocol in zip(axes, protocols):
        for fam, (color, marker) in style.items():
            pts = sorted((r["storage_bits_per_element"], r["ppl"], n) for (p, n), r in res.items()
                         if p == protocol and family(n) == fam)
            if not pts:
                continue
            if fam in ("pq", "pq+norms", "pq+unit", "pq+g2"):  # mean of the seeds per budget, seeds as points
                by = {}
                for b, y, _ in pts:
                    by.setdefault(b, []).append(y)
                ax.scatter([b for b, _, _ in pts], [y for _, y, _ in pts], color=color, marker=marker, alpha=0.4)
                xs = sorted(by)
                label = {"pq": "pq (calibrate --bits B, the recipe of its day; mean of 2 seeds)",
                         "pq+norms": "pq + a bf16 norm per vector (today's codebooks rescaled)",
                         "pq+unit": "pq + norm, codebooks of unit vectors (NEQ; calibrate --bits 2)",
                         "pq+g2": "pq, keys before RoPE, 2 RoPE pairs per sub-space (pq2-pre-g2 / -n / -nu)"}[fam]
                ax.plot(xs, [sum(by[x]) / len(by[x]) for x in xs], color=color, marker=marker, label=label)
            elif fam == "kivi":
                ax.scatter([b for b, _, _ in pts], [y for _, y, _ in pts], color=color, marker=marker, label="KIVI")
                for b, y, n in pts:
                    ax.annotate(n.replace("kivi", "int"), (b, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            else:
                ax.plot([b for b, _, _ in pts], [y for _, y, _ in pts], color=color, marker=marker, label=fam)
        if dense:
            ax.axhline(dense["ppl"], color="k", ls="--", lw=1, label=f"dense bf16 ({dense['ppl']:.2f})")
            ax.set_ylim(dense["ppl"] * 0.98, dense["ppl"] * preset["ylim"][protocol])
        ax.set_xlabel("stored bits per K/V element (codes + norms / scales)")
        ax.set_ylabel("perplexity (lower is better)")
        tokens = sorted({r.get("max_tokens") for (p, _), r in res.items() if p == protocol} - {None})
        ax.set_title(f"{preset['label']}, {text} {'/'.join(map(str, tokens))} tokens, protocol {protocol}"
                     + (" (every token from codes)" if protocol == "all" else " (exact sinks/recent)"), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/frontier")
    p.add_argument("--codebooks-dir", default="/tmp/fr")
    p.add_argument("--protocol", default="all,realistic")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", default="builtin:eval")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--only", help="comma-separated row names")
    p.add_argument("--table", action="store_true", help="only write results.md and frontier.png")
    p.add_argument("--calibrate", action="store_true",
                   help="first make the missing pq codebook files with the model's calibrate flags (MODELS)")
    qj = p.add_mutually_exclusive_group()
    qj.add_argument("--qjl", dest="qjl", action="store_true", default=None,
                    help="run the turboquant+qjl rows (default: smollm2 yes, gemma3-270m no)")
    qj.add_argument("--no-qjl", dest="qjl", action="store_false")
    args = p.parse_args()
    if args.table:
        table(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
