"""Issue 34, the needle grid: one cache against another on the same prompts, prompt by prompt.

Reads ``million-jax niah`` JSONs of a reference cache (``--ref``, usually dense) and of another
cache (``--other``) run with the same ``--lengths / --depths / --trials / --seed``, so every
(length, depth, trial) cell holds the same key in both; several files per side are pooled (one
per group of lengths). Per side: prompts found (greedy). Paired: prompts both find, the prompts
where they differ, and the mean loss of log p(key) (teacher forced) other vs reference with its
standard error, over the prompts whose reference log p is above ``--floor`` (default -5 nats:
drops the cells at SmolLM2's context edge where every cache scores about -17).

    PYTHONPATH=. python benchmarks/niah_paired.py \\
        --ref benchmarks/results/frontier/smollm2_32k/niah_grid_3trials_{1k-2k,4k,8k}_dense.json \\
        --other benchmarks/results/frontier/smollm2_32k/niah_grid_3trials_{1k-2k,4k,8k}_po_f16_s0.json
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any, Sequence

Cell = tuple[int, float, int]  # (length, depth, trial index)


def niah_trials(results: Sequence[dict[str, Any]]) -> dict[Cell, dict[str, Any]]:
    """The trial rows of ``niah`` results (each JSON holding one cache) keyed by (length, depth,
    trial). ValueError when a result holds several caches or two results hold the same cell."""
    out: dict[Cell, dict[str, Any]] = {}
    for r in results:
        if len(r["results"]) != 1:
            raise ValueError(f"a niah JSON per cache, got caches {sorted(r['results'])}")
        (res,) = r["results"].values()
        for c in res["cells"]:
            for i, t in enumerate(c["trials"]):
                cell = (int(c["length"]), float(c["depth"]), i)
                if cell in out:
                    raise ValueError(f"cell {cell} (length, depth, trial) is in two files")
                out[cell] = t
    return out


def paired(ref: dict[Cell, dict[str, Any]], other: dict[Cell, dict[str, Any]], *,
           floor: float = -5.0) -> dict[str, Any]:
    """Found per side, found by both, the differing prompts and the paired log p(key) loss
    (ref - other, nats: mean, sample sd, standard error) over the prompts with ref log p > floor.
    ValueError unless both sides hold the same cells with the same keys."""
    if set(ref) != set(other):
        raise ValueError(f"the two sides hold different cells: only in ref {sorted(set(ref) - set(other))[:5]}, "
                         f"only in other {sorted(set(other) - set(ref))[:5]}")
    wrong = [c for c in ref if ref[c]["key"] != other[c]["key"]]
    if wrong:
        raise ValueError(f"different keys in cells {wrong[:5]}: not the same prompts (--seed / --trials / --lengths)")
    cells = sorted(ref)
    losses = [ref[c]["key_logp"] - other[c]["key_logp"] for c in cells if ref[c]["key_logp"] > floor]
    n = len(losses)
    mean = sum(losses) / n if n else math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in losses) / (n - 1)) if n > 1 else math.nan
    return {
        "prompts": len(cells),
        "ref_found": sum(bool(ref[c]["correct"]) for c in cells),
        "other_found": sum(bool(other[c]["correct"]) for c in cells),
        "both_found": sum(bool(ref[c]["correct"] and other[c]["correct"]) for c in cells),
        "differ": [{"length": c[0], "depth": c[1], "trial": c[2], "ref_found": bool(ref[c]["correct"]),
                    "other_found": bool(other[c]["correct"]), "ref_logp": ref[c]["key_logp"],
                    "other_logp": other[c]["key_logp"], "other_answer": other[c]["answer"]}
                   for c in cells if bool(ref[c]["correct"]) != bool(other[c]["correct"])],
        "loss_prompts": n, "floor": floor,
        "mean_logp_loss": round(mean, 4), "sd": round(sd, 4), "se": round(sd / math.sqrt(n), 4) if n > 1 else math.nan,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", nargs="+", required=True, help="niah JSONs of the reference cache")
    p.add_argument("--other", nargs="+", required=True, help="niah JSONs of the other cache, the same prompts")
    p.add_argument("--floor", type=float, default=-5.0, help="reference log p(key) at or below it: not in the loss")
    p.add_argument("--json", help="write the summary here")
    a = p.parse_args()

    def load(paths: Sequence[str]) -> dict[Cell, dict[str, Any]]:
        return niah_trials([json.load(open(x)) for x in paths])

    try:
        s = paired(load(a.ref), load(a.other), floor=a.floor)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(f"{s['prompts']} prompts: ref found {s['ref_found']}, other {s['other_found']}, both {s['both_found']}; "
          f"log p(key) loss {s['mean_logp_loss']:+.3f} nats (sd {s['sd']:.3f}, se {s['se']:.3f}) "
          f"over {s['loss_prompts']} prompts with ref log p > {a.floor:g}")
    for d in s["differ"]:
        print(f"  differ at {d['length']} / {d['depth']:.0%} / trial {d['trial']}: ref {d['ref_found']} "
              f"({d['ref_logp']:.2f}), other {d['other_found']} ({d['other_logp']:.2f}) {d['other_answer']!r}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ref": a.ref, "other": a.other, **s}, f, indent=1)


if __name__ == "__main__":
    main()
