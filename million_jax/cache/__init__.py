"""KV caches: one protocol (base.KVCache / base.LayerState), several storage kinds."""
from million_jax.cache.base import CacheOverflowError, KVCache, LayerState
from million_jax.cache.dense import DenseCache, DenseLayer
from million_jax.cache.pq_cache import PQCache, PQLayer
from million_jax.cache.uniform_cache import UniformCache, UniformLayer
from million_jax.cache.kivi_cache import KiviCache, KiviLayer
from million_jax.cache.turboquant_cache import TurboQuantCache, TurboQuantConsts, TurboQuantLayer

__all__ = ["CacheOverflowError", "KVCache", "LayerState", "DenseCache", "DenseLayer", "PQCache", "PQLayer",
           "UniformCache", "UniformLayer", "KiviCache", "KiviLayer", "TurboQuantCache", "TurboQuantConsts",
           "TurboQuantLayer"]
