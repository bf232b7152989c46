"""million-jax: product-quantized KV caches and attention from codes for JAX.

Public API (re-exported here):
  k-means / PQ:   kmeans, fit_codebooks, encode, decode, Codebooks,
                  bits_per_element, save_codebooks, load_codebooks
  caches:         KVCache (protocol), DenseCache
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
from million_jax.cache.base import KVCache

__all__ = [
    "CodebookFileError",
    "Codebooks",
    "KMeansResult",
    "KVCache",
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
