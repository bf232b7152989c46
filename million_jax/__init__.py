"""million-jax: product-quantized KV caches and attention from codes for JAX.

Public API (re-exported here):
  k-means / PQ:   kmeans, fit_codebooks, encode, decode, Codebooks,
                  bits_per_element, save_codebooks, load_codebooks
  model codebooks PQCodebooks (key + value, laid out per layer)
  caches:         KVCache / LayerState (protocol), DenseCache, PQCache, UniformCache,
                  TurboQuantCache (calibration-free), KiviCache (KIVI as published),
                  CacheSpec + make_cache (any kind from a model shape)
  attention:      pq_code_attention (the one kernel-dispatch point)
  calibration:    collect_kv, fit_kv_codebooks
"""
from million_jax.quant.codebook_io import CodebookFileError, load_codebooks, save_codebooks
from million_jax.quant.kmeans import KMeansResult, kmeans
from million_jax.quant.pq import (
    Codebooks,
    bits_per_element,
    code_dtype,
    decode,
    encode,
    fit_codebooks,
    reconstruction_mse,
)
from million_jax.quant.kv_codebooks import GRANULARITIES, PQCodebooks
from million_jax.cache import (CacheOverflowError, DenseCache, DenseLayer, KVCache, LayerState, PQCache, PQLayer, UniformCache,
                               UniformLayer)
from million_jax.cache import KiviCache, TurboQuantCache, TurboQuantConsts
from million_jax.cache.spec import CACHE_KINDS, CacheShape, CacheSpec, make_cache
from million_jax.calibration.fit import collect_kv, fit_kv_codebooks
from million_jax.attention.pq_dispatch import pq_code_attention

__all__ = [
    "CACHE_KINDS",
    "CacheShape",
    "CacheSpec",
    "CodebookFileError",
    "Codebooks",
    "GRANULARITIES",
    "KMeansResult",
    "DenseCache",
    "DenseLayer",
    "KVCache",
    "CacheOverflowError",
    "LayerState",
    "PQCache",
    "PQCodebooks",
    "PQLayer",
    "UniformCache",
    "UniformLayer",
    "KiviCache",
    "TurboQuantCache",
    "TurboQuantConsts",
    "collect_kv",
    "fit_kv_codebooks",
    "bits_per_element",
    "code_dtype",
    "decode",
    "encode",
    "fit_codebooks",
    "kmeans",
    "load_codebooks",
    "make_cache",
    "pq_code_attention",
    "reconstruction_mse",
    "save_codebooks",
]
