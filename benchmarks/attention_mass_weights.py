"""Attention-mass-weighted k-means for pq4-qa (keys and values): does weighting each calibration
vector by the attention it receives help? (issue 13; results in
benchmarks/results/kmeans_weighting_smollm2/)

    PYTHONPATH=. python benchmarks/attention_mass_weights.py OUT.json "none;2,0.1;1,0.1;2,0.1,k;2,0.1,v"

Each variant is "power,floor[,k|v|kv]": weights = mass / mean(mass) + floor with
mass[t] = sum over sampled queries (128 per 512-token window) and their GQA heads of p(q -> t)**power,
the model's causal softmax inside the window; "none" = unweighted. 16384 calibration tokens of
builtin:calib, pq4-qa (2-dim sub-vectors, 8-bit codes, query-aware keys, layer_head), ppl on
4096 tokens of builtin:eval in 512-token windows, every key/value from codes.
"""
import json, sys, time
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
from million_jax import CacheSpec
from million_app.calibrate import calibration_kvq_samples
from million_app.flags import load_text
from million_app.loading import open_model, tokenize
from million_app.perplexity import evaluate
from million_jax.calibration.fit import fit_kv_codebooks
from million_jax.quant.kv_transforms import query_aware_key_transform

out_path = sys.argv[1]
variants = sys.argv[2].split(";")  # e.g. "none;1,0.1;2,0.1"
max_vectors = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
iters = int(sys.argv[4]) if len(sys.argv) > 4 else 8
model = open_model("smollm2")
c = model.config
eval_ids = tokenize(model, load_text("builtin:eval", "--text"))
calib_ids = tokenize(model, load_text("builtin:calib", "--calib"))
t0 = time.perf_counter()
k, v, gram, count, q, q_pos, used = calibration_kvq_samples(model, calib_ids, tokens=16384, window=512,
                                                            queries_per_window=128)
print("calib", time.perf_counter() - t0, k.shape, q.shape, flush=True)
W = 512
L, hkv, N, d = k.shape
nw = N // W
S = q.shape[3] // nw

@jax.jit
def layer_probs(ql, kl, pos):
    # ql [Hkv, G, nw, S, d]; kl [Hkv, nw, W, d]; pos [nw, S] -> p [Hkv, G, nw, S, W]
    s = jnp.einsum("hgwsd,hwtd->hgwst", ql, kl) / np.sqrt(d)
    mask = jnp.arange(W)[None, None, :] <= pos[:, :, None]
    s = jnp.where(mask[None, None], s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1)

pos = (q_pos % W).reshape(nw, S)
P1 = np.zeros((L, hkv, N), np.float32); P2 = np.zeros((L, hkv, N), np.float32)
for l in range(L):
    p = layer_probs(jnp.asarray(q[l]).reshape(hkv, -1, nw, S, d), jnp.asarray(k[l]).reshape(hkv, nw, W, d), jnp.asarray(pos))
    P1[l] = np.asarray(jnp.sum(p, axis=(1, 3))).reshape(hkv, N)
    P2[l] = np.asarray(jnp.sum(p * p, axis=(1, 3))).reshape(hkv, N)
print("mass share of position 0:", float(P1.reshape(L, hkv, nw, W)[..., 0].sum() / P1.sum()),
      "p2:", float(P2.reshape(L, hkv, nw, W)[..., 0].sum() / P2.sum()), flush=True)
kt = query_aware_key_transform(gram, count)
rows = []
dense = evaluate(model, eval_ids, CacheSpec("dense"), window=512, max_tokens=4096)
rows.append(dict(variant="dense", ppl=dense["ppl"]))
print("dense", dense["ppl"], flush=True)
for var in variants:
    if var == "none":
        kw, vw = None, None
    else:
        power, floor, *which = var.split(",")
        P = P1 if power == "1" else P2
        wts = P / P.mean(axis=-1, keepdims=True) + float(floor)
        which = which[0] if which else "kv"
        kw = wts if "k" in which else None
        vw = wts if "v" in which else None
    t0 = time.perf_counter()
    books = fit_kv_codebooks(k, v, M=32, nbits=8, granularity="layer_head", key=jax.random.PRNGKey(0),
                             max_vectors=max_vectors, iters=iters, key_transform=kt, key_weights=kw, value_weights=vw)
    fit_s = time.perf_counter() - t0
    r = evaluate(model, eval_ids, CacheSpec("pq", codebooks=books, quantize_all=True), window=512, max_tokens=4096)
    rows.append(dict(variant=var, ppl=r["ppl"], rel=r["ppl"] / dense["ppl"] - 1, fit_s=fit_s))
    print(var, r["ppl"], f"{100 * (r['ppl'] / dense['ppl'] - 1):+.2f}%", round(fit_s), flush=True)
    json.dump(dict(max_vectors=max_vectors, iters=iters, rows=rows), open(out_path, "w"), indent=1)
