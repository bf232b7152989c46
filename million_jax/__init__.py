"""million-jax: product-quantized KV caches and attention from codes for JAX.

Public API (re-exported here):
  k-means / PQ:   kmeans, fit_codebooks, encode, decode, Codebooks,
                  bits_per_element, save_codebooks, load_codebooks
  caches:         KVCache (protocol), DenseCache, PQCache (+ PQCodebooks), UniformCache
  calibration:    collect_kv, fit_kv_codebooks
"""
from million_jax.codebook_io import CodebookFileError, load_codebooks, save_codebooks
from million_jax.kmeans import KMeansResult, kmeans
from million_jax.pq import (
    Codebooks,
    bits_per_element,
    code_dtype,
    decode,
    encode,
    fit_codebooks,
    reconstruction_mse,
    storage_bits_per_element,
)
from million_jax.cache import DenseCache, KVCache, PQCache, PQCodebooks, UniformCache
from million_jax.calibration import collect_kv, fit_kv_codebooks

__all__ = [
    "CodebookFileError",
    "Codebooks",
    "KMeansResult",
    "DenseCache",
    "KVCache",
    "PQCache",
    "PQCodebooks",
    "UniformCache",
    "collect_kv",
    "fit_kv_codebooks",
    "bits_per_element",
    "code_dtype",
    "decode",
    "encode",
    "fit_codebooks",
    "kmeans",
    "load_codebooks",
    "reconstruction_mse",
    "save_codebooks",
    "storage_bits_per_element",
]
