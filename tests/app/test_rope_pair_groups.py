"""Keys before RoPE in sub-spaces of two RoPE pairs (pq2-pre-g2): `calibrate --rope pre --M d/4`
records them, and a model reading them through the PQ cache gives the log-likelihood of the same
model whose keys and values are replaced by their reconstructions (an independent path:
``benchmarks/pq_loss_split.py`` rotates the decoded keys in the model's layout, no lookup tables)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks.pq_loss_split import make as reconstructed_cache
from million_app.calibrate import load_model_codebooks, windows
from million_app.flags import load_text
from million_app.loading import tokenize
from million_app.perplexity import window_nll
from million_jax.cache.spec import CacheSpec
from million_jax.quant.codebook_io import load_codebooks
from million_app import caches

CALIB = ("--text", "builtin:calib", "--tokens", "1024", "--window", "256", "--iters", "3", "--quiet")


def test_two_pair_subspaces_calibrated_and_read_like_their_reconstructions(cli, tiny_dir, tiny, tmp_path):
    d = tiny.config.head_dim
    path = tmp_path / "g2.safetensors"
    res = cli("calibrate", "--model", tiny_dir, *CALIB, "--rope", "pre", "--M", str(d // 4), "--nbits", "8",
              "--out", path)
    assert res.rc == 0, res.err
    books, _ = load_model_codebooks(str(path), tiny)
    assert books.key_rope == "pre" and books.key_rope_pairs == 2 and books.key.dsub == 4
    meta = load_codebooks(str(path))[1]
    assert meta["bits_per_element"] == 2.0 and books.recipe.endswith(" pre g2")
    assert caches.label(CacheSpec("pq", codebooks=books)) == f"pq K{d // 4}x8 V{d // 4}x8 pre g2 layer_head"

    w = windows(tokenize(tiny, load_text("builtin:eval", "--text")), 64, 256)  # 4 windows of 64
    spec = CacheSpec("pq", codebooks=books, dtype=jnp.float32, quantize_all=True, impl="xla")
    cache, consts = caches.build(spec, tiny.config, len(w), w.shape[1])
    got = np.asarray(window_nll(tiny.config, tiny.params, cache, jnp.asarray(w), consts))
    recon = reconstructed_cache(tiny.config, books, len(w), w.shape[1])
    want = np.asarray(window_nll(tiny.config, tiny.params, recon, jnp.asarray(w), books))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    exact = caches.build(CacheSpec("dense", dtype=jnp.float32), tiny.config, len(w), w.shape[1])
    dense = np.asarray(window_nll(tiny.config, tiny.params, exact[0], jnp.asarray(w), exact[1]))
    assert np.abs(got - dense).max() > 100 * 2e-4  # the codes really are read (not the exact keys)
