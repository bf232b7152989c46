"""KV caches: one protocol (base.KVCache), several storage kinds."""
from million_jax.cache.base import KVCache
from million_jax.cache.dense import DenseCache
from million_jax.cache.pq_cache import PQCache, PQCodebooks
from million_jax.cache.uniform_cache import UniformCache

__all__ = ["KVCache", "DenseCache", "PQCache", "PQCodebooks", "UniformCache"]
