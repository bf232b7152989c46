"""``million-jax niah``: a needle-in-a-haystack grid, context length x needle depth, per cache.

Each cell (length L, depth d) runs ``trials`` passkey prompts (:mod:`million_app.passkey`: the
needle "The pass key is K..." placed at fraction d of the filler, greedy answer, correct when
the first number generated is K) with keys drawn from ``seed``; accuracy per cell. The same
prompts go through every cache, so the grids compare like with like. ``heatmap`` draws one
panel per cache (matplotlib, imported only there).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from million_app import caches, progress
from million_app.errors import UsageError
from million_app.passkey import mean_key_logp, passkey_prompt, run_trials
from million_jax.cache.spec import CacheSpec
from models import LoadedModel


def parse_depths(text: str) -> list[float]:
    """'0,0.25,0.5' -> [0.0, 0.25, 0.5], each in [0, 1]."""
    try:
        depths = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--depths must be comma-separated numbers in [0, 1], got {text!r}") from None
    if not depths or any(not 0 <= x <= 1 for x in depths):
        raise UsageError(f"--depths must be comma-separated numbers in [0, 1], got {text!r}")
    return depths


def draw_cells(rng: np.random.Generator, depths: Sequence[float], trials: int) -> list[tuple[float, int]]:
    """One length's cells: (depth, key) for each depth, ``trials`` keys each, drawn from ``rng``
    (the grid draws them length by length, so any tool that repeats these draws in the same
    order rebuilds the grid's prompts)."""
    return [(d, int(k)) for d in depths for k in rng.integers(10000, 100000, size=trials)]


def by_depth(rows: Sequence[dict[str, Any]], n_depths: int, trials: int) -> list[Sequence[dict[str, Any]]]:
    """One length's trial rows (``run_trials``, ``trials`` per depth in order, as ``draw_cells``
    lays them out) -> one list of ``trials`` rows per depth."""
    return [rows[i * trials:(i + 1) * trials] for i in range(n_depths)]


def cell_scores(rows: Sequence[dict[str, Any]], n_depths: int, trials: int) -> tuple[list[float], list[float]]:
    """One length's trial rows (:func:`by_depth`) -> (accuracy, mean log p(key)) per depth."""
    cells = by_depth(rows, n_depths, trials)
    return [sum(r["correct"] for r in c) / trials for c in cells], [mean_key_logp(c) for c in cells]


def niah_grid(model: LoadedModel, specs: Sequence[CacheSpec], lengths: Sequence[int], depths: Sequence[float], *,
              trials: int = 1, seed: int = 0, batch: int = 5,
              prefill_chunk: int | None = None) -> dict[str, Any]:
    """{"lengths", "depths", "results": {label: {"accuracy": [[per depth] per length],
    "key_logp": [[mean log p(key) per depth] per length], "cells": [...]}}}.

    ``key_logp`` (teacher-forced log p of the right answer, :func:`million_app.passkey.run_trials`)
    is the finer score: a cell's accuracy flips on a near-tie, its log p moves smoothly.
    """
    rng = np.random.default_rng(seed)
    labels = [caches.label(s) for s in specs]
    out: dict[str, Any] = {"lengths": list(lengths), "depths": list(depths), "trials": trials, "seed": seed,
                           "results": {lab: {"accuracy": [], "key_logp": [], "cells": []} for lab in labels}}
    pbar = progress.bar(len(lengths) * len(specs) * len(depths) * trials, "niah", unit="prompt")
    try:
        for length in lengths:
            cells = draw_cells(rng, depths, trials)
            prompts = [passkey_prompt(model, length, k, d) for d, k in cells]
            for spec, lab in zip(specs, labels):
                progress.status(f"niah length {length}: {lab} ({len(prompts)} prompts)")
                rows = run_trials(model, prompts, [k for _, k in cells], spec, min(batch, len(prompts)),
                                  prefill_chunk)
                pbar.update(len(rows))
                acc, logp = cell_scores(rows, len(depths), trials)
                out["results"][lab]["cells"] += [{"length": length, "depth": d, "trials": cell}
                                                 for d, cell in zip(depths, by_depth(rows, len(depths), trials))]
                out["results"][lab]["accuracy"].append(acc)
                out["results"][lab]["key_logp"].append(logp)
    finally:
        pbar.close()
    return out


def heatmap(result: dict[str, Any], path: str, title: str = "") -> None:
    """One accuracy heatmap (length x depth) per cache, side by side, written to ``path`` (PNG);
    each cell also shows its mean log p(key) where the grid has it (grids made before 2026-12-06
    hold accuracy only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["results"])
    fig, axes = plt.subplots(1, len(labels), figsize=(3.2 * len(labels) + 1, 3.4), squeeze=False)
    for ax, lab in zip(axes[0], labels):
        acc = np.asarray(result["results"][lab]["accuracy"], float)
        logp = result["results"][lab].get("key_logp")
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]], fontsize=7)
        ax.set_yticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]], fontsize=7)
        ax.set_xlabel("needle depth")
        if ax is axes[0][0]:
            ax.set_ylabel("context tokens")
        ax.set_title(lab, fontsize=8)
        for i in range(acc.shape[0]):
            for j in range(acc.shape[1]):
                text = f"{acc[i, j]:.0%}" + (f"\n{logp[i][j]:.2f}" if logp else "")
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
    has_logp = any("key_logp" in r for r in result["results"].values())
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8,
                 label="accuracy" + ("\n(cell text: accuracy, mean log p(key))" if has_logp else ""))
    if title:
        fig.suptitle(title, fontsize=9, y=1.02)
    fig.savefig(path, dpi=110, bbox_inches="tight", format="png")
    plt.close(fig)
