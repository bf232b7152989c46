"""Drop-in PQ attention for Flax models: NNX and Linen layers whose decode cache is PQ codes.

    from million_jax.flax import PQMultiHeadAttention            # for nnx.MultiHeadAttention
    from million_jax.flax import PQMultiHeadDotProductAttention  # for linen.MultiHeadDotProductAttention

Codebooks come from the user's own model (:func:`calibrate_nnx`, :func:`calibrate_linen`) or
from a file (``million_jax.quant.codebook_io.load_kv_codebooks``, e.g. of ``million-jax calibrate``).
Tokens past ``init_cache``'s max_length raise ``CacheOverflowError`` eagerly and set the sticky
``overflow`` cache flag under jit (:func:`cache_overflow` reads it for a whole model).
"""
from million_jax.flax.linen_attention import (CODEBOOK_COLLECTION, PQMultiHeadDotProductAttention, calibrate_linen,
                                              linen_codebooks, linen_pq_layers)
from million_jax.flax.nnx_attention import PQCodebook, PQMultiHeadAttention, attach_codebooks, calibrate_nnx, pq_layers
from million_jax.flax.overflow import cache_overflow

__all__ = ["CODEBOOK_COLLECTION", "PQCodebook", "PQMultiHeadAttention", "PQMultiHeadDotProductAttention",
           "attach_codebooks", "cache_overflow", "calibrate_linen", "calibrate_nnx", "linen_codebooks",
           "linen_pq_layers", "pq_layers"]
