"""benchmarks/niah_paired.py: the paired per-prompt comparison of two caches' niah JSONs."""
import math

import numpy as np
import pytest

from benchmarks.niah_paired import niah_trials, paired


def _niah(lengths, depths, keys, logp, correct, label="cache"):
    """A niah JSON (the fields niah_paired reads): keys/logp/correct[length][depth][trial]."""
    cells = [{"length": n, "depth": d, "trials": [{"key": int(keys[i][j][t]), "key_logp": float(logp[i][j][t]),
                                                   "correct": bool(correct[i][j][t]), "answer": " x"}
                                                  for t in range(keys.shape[2])]}
             for i, n in enumerate(lengths) for j, d in enumerate(depths)]
    return {"lengths": lengths, "depths": depths, "results": {label: {"cells": cells}}}


def test_paired_loss_and_counts_match_numpy_on_random_runs():
    rng = np.random.default_rng(7)
    shape = (2, 3, 3)
    keys = rng.integers(10000, 99999, shape)
    ref_lp, oth_lp = -rng.gamma(2.0, 0.4, shape), -rng.gamma(2.0, 0.45, shape)
    ref_lp[0, 0, 1] = -17.0  # a context-edge prompt: out of the loss
    ref_ok, oth_ok = rng.random(shape) < 0.8, rng.random(shape) < 0.7
    lengths, depths = [1024, 2048], [0.0, 0.5, 1.0]
    # the reference split over two files (one per length), as niah runs per group of lengths
    ref = niah_trials([_niah([1024], depths, keys[:1], ref_lp[:1], ref_ok[:1]),
                       _niah([2048], depths, keys[1:], ref_lp[1:], ref_ok[1:])])
    s = paired(ref, niah_trials([_niah(lengths, depths, keys, oth_lp, oth_ok)]), floor=-5.0)
    keep = ref_lp > -5.0
    loss = (ref_lp - oth_lp)[keep]
    assert s["prompts"] == 18 and s["loss_prompts"] == 17
    assert (s["ref_found"], s["other_found"], s["both_found"]) == (ref_ok.sum(), oth_ok.sum(), (ref_ok & oth_ok).sum())
    assert s["mean_logp_loss"] == pytest.approx(loss.mean(), abs=1e-4)
    assert s["sd"] == pytest.approx(loss.std(ddof=1), abs=1e-4)
    assert s["se"] == pytest.approx(loss.std(ddof=1) / math.sqrt(17), abs=1e-4)
    assert len(s["differ"]) == int((ref_ok != oth_ok).sum())


def test_paired_refuses_other_prompts_and_duplicate_cells():
    keys = np.full((1, 1, 2), 12345)
    lp, ok = np.full((1, 1, 2), -1.0), np.ones((1, 1, 2), bool)
    ref = niah_trials([_niah([1024], [0.5], keys, lp, ok)])
    with pytest.raises(ValueError, match="different keys"):
        paired(ref, niah_trials([_niah([1024], [0.5], keys + 1, lp, ok)]))
    with pytest.raises(ValueError, match="different cells"):
        paired(ref, niah_trials([_niah([2048], [0.5], keys, lp, ok)]))
    with pytest.raises(ValueError, match="in two files"):
        niah_trials([_niah([1024], [0.5], keys, lp, ok)] * 2)
    two = _niah([1024], [0.5], keys, lp, ok)
    two["results"]["dense"] = two["results"]["cache"]
    with pytest.raises(ValueError, match="a niah JSON per cache"):
        niah_trials([two])
