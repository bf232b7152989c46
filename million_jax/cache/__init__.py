"""KV caches: one protocol (base.KVCache / base.LayerState), several storage kinds."""
from million_jax.cache.base import CacheOverflowError, KVCache, LayerState
from million_jax.cache.dense import DenseCache, DenseLayer
from million_jax.cache.pq_cache import PQCache, PQLayer
from million_jax.cache.uniform_cache import UniformCache, UniformLayer

__all__ = ["CacheOverflowError", "KVCache", "LayerState", "DenseCache", "DenseLayer", "PQCache", "PQLayer",
           "UniformCache", "UniformLayer"]
