"""Plot perplexity loss against stored bits per element for the PQ recipes (issue 13).

    PYTHONPATH=. python benchmarks/plot_recipes.py --out benchmarks/results/recipes_smollm2/ppl_vs_bits.png

Reads the committed results (no model run): every PQ recipe of
``benchmarks/results/recipes_smollm2`` (protocol ``all``, plus ``residual/``) and of its
``realistic/`` table, and the KIVI-style and per-token int rows of
``benchmarks/results/sweep_smollm2`` (a different evaluation set: 8192 tokens instead of 4096,
so each point is its ppl relative to the dense row of its own run). y: ppl / dense - 1 (%),
log scale; x: stored bits per element, keys and values together, exact tokens excluded.
"""
from __future__ import annotations

import argparse
import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _rows(path: str, name_key: str) -> list[tuple[str, float, float]]:
    """(name, stored bits/elem, ppl loss in %) of every non-dense row, against its own dense row."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    is_dense = lambda r: r.get("recipe", r.get("name")) == "dense"  # noqa: E731
    dense = next(r["ppl"] for r in rows if is_dense(r))
    # results committed before the rename to bits_per_element spell it storage_bits_per_elem
    bits = lambda r: r.get("storage_bits_per_element", r.get("storage_bits_per_elem"))  # noqa: E731
    return [(r[name_key], bits(r), 100 * (r["ppl"] / dense - 1)) for r in rows if not is_dense(r)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(HERE, "recipes_smollm2", "ppl_vs_bits.png"))
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = os.path.join(HERE, "recipes_smollm2")
    series = {
        "PQ recipes, all from codes": _rows(os.path.join(rec, "results.json"), "recipe")
        + _rows(os.path.join(rec, "residual", "results.json"), "recipe"),
        "PQ recipes, 4 exact sinks + 64 recent": _rows(os.path.join(rec, "realistic", "results.json"), "recipe"),
        "KIVI-style / per-token int, all (sweep)": [
            r for r in _rows(os.path.join(HERE, "sweep_smollm2", "results.json"), "label")
            if r[0].startswith("uniform")],
    }
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for (label, pts), marker in zip(series.items(), ("o", "s", "^")):
        ax.scatter([b for _, b, _ in pts], [max(y, 0.05) for _, _, y in pts], marker=marker, label=label)
        for name, b, y in pts:
            ax.annotate(name.replace("uniform ", ""), (b, max(y, 0.05)), fontsize=7, xytext=(3, 2),
                        textcoords="offset points")
    for y, text in ((1.0, "target 4 b/elem: +1%"), (15.0, "target 2 b/elem: +15%")):
        ax.axhline(y, color="grey", lw=0.8, ls="--")
        ax.text(0.85, y * 1.05, text, fontsize=7, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per K/V element (keys and values together)")
    ax.set_ylabel("perplexity vs dense of the same run (%)")
    ax.set_title("SmolLM2-135M, builtin:eval, 512-token windows (recipes_smollm2, sweep_smollm2)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
