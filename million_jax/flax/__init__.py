"""Drop-in PQ attention for Flax models: NNX and Linen layers whose decode cache is PQ codes.

    from million_jax.flax import PQMultiHeadAttention            # for nnx.MultiHeadAttention
    from million_jax.flax import PQMultiHeadDotProductAttention  # for linen.MultiHeadDotProductAttention

Codebooks come from the user's own model (:func:`calibrate_nnx`, :func:`calibrate_linen`) or
from a file (``million_jax.quant.codebook_io.load_kv_codebooks``, e.g. of ``million-jax calibrate``).
"""
from million_jax.flax.linen_attention import (CODEBOOK_COLLECTION, PQMultiHeadDotProductAttention, calibrate_linen,
                                              linen_codebooks, linen_pq_layers)
from million_jax.flax.nnx_attention import PQCodebook, PQMultiHeadAttention, attach_codebooks, calibrate_nnx, pq_layers

__all__ = ["CODEBOOK_COLLECTION", "PQCodebook", "PQMultiHeadAttention", "PQMultiHeadDotProductAttention",
           "attach_codebooks", "calibrate_linen", "calibrate_nnx", "linen_codebooks", "linen_pq_layers", "pq_layers"]
