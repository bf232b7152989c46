"""PQ recipes: key / value budgets and transforms by name, and the recipe picked for a bit budget.

A recipe is what ``million-jax calibrate --bits B`` fits without the user choosing knobs:

    key_dsub, key_nbits       keys: sub-vectors of key_dsub dims, codes of key_nbits bits
    value_dsub, value_nbits   values alike
    query_aware               keys fitted on A k, A = (E[q q^T])^(1/2) per layer and KV head
    output_aware              values fitted on B v, B = (sum Wo_h Wo_h^T)^(1/2) per KV head
    finetune_steps            > 0: the k-means centroids are then fine-tuned with that many Adam
                              steps per layer on the attention-output error over calibration
                              (q, k, v) (:mod:`million_jax.calibration.finetune`); needs query samples
    finetune_reassign         0: codes fixed at the k-means assignment during fine-tuning;
                              n > 0: re-encoded every n steps
    stages                    > 1: residual PQ (:mod:`million_jax.quant.residual_pq`), each stage a
                              PQ of the given dsub / nbits on what the previous stages left
    rope                      "post": keys quantized after RoPE (MILLION's choice); "pre": before
                              RoPE, one sub-space per RoPE pair (key_dsub 2, no query-aware keys,
                              no fine-tuning), rotated inside attention; fitted on keys collected
                              with ``key_rope="pre"`` (``million_app.calibrate.calibration_kvq``)
    norms                     True: norm-explicit PQ, the same k-means codebooks plus one bf16
                              scale |x| / |x_hat| per token beside the key and the value codes
                              (:mod:`million_jax.quant.kv_codebooks`; 16 / head_dim more bits per
                              element each, not counted in ``bits_per_element``)
    unit                      with norms: the codebooks are fitted on unit vectors and the cache
                              encodes x / |x| (NEQ); the norm lives only in the scale
    pair_widths               (lo, hi) or None: pre-RoPE keys in 2-dim sub-spaces (one RoPE pair each)
                              get key codebooks of every width lo..hi bits, and one allocation for
                              the model gives each pair a width at the mean of key_nbits, by the
                              query-weighted key error (:mod:`million_jax.calibration.pair_bits`); the
                              cache stores each pair's codes at its width (same bits per element)
    pair_order                with pair_widths: one width per key sub-space for the model, and each
                              (layer, KV head) puts its own RoPE pairs into those sub-spaces
                              (``PQCodebooks.key_pair_order``; codebooks per KV head)
    value_pca                 values (2-dim sub-spaces) coded in their principal axes per layer
                              and KV head, the i-th widest axis paired with the i-th narrowest
                              (:func:`million_jax.quant.kv_transforms.value_pca_transform`, held as
                              the codebooks' value transform, an orthogonal matrix); not with
                              output_aware

Stored bits per element (keys and values together) = stages * (key_nbits / key_dsub +
value_nbits / value_dsub) / 2. ``BEST_FOR_BITS`` holds, per budget, the recipe that measured
best on SmolLM2-135M (benchmarks/results/recipes_smollm2/: 4096 tokens of builtin:eval, every
key/value read from codes, ppl vs dense 11.260; every recipe of ``RECIPES`` measured, 2026-12-02):

    4 b/elem  pq4-qa  +2.0%    (pq4 +2.7%, pq4-qa-ow +3.7%, pq4-qa-k3v5 +8.9%; residual:
                               pq4-r2-qa +3.7%, pq4-r2 +3.9%, pq4-r4-qa +4.2%)
    3 b/elem  pq3-qa  +11.9%   (pq3-r2-qa +14.1%)
    2 b/elem  pq2-r2-qa  +35.9%   (two residual stages of 8-dim sub-vectors; pq2-qa +44.0%,
                                pq2-qa-ow +46.1%, pq2 +53.4%, pq2-qa-k1v3 +147.3%;
                                recipes_smollm2/residual/)
    1 b/elem  pq1-qa  +290.5%  (the only 1 b/elem recipe; measured, but far from usable)

Keys before RoPE (``rope="pre"``, the default of ``calibrate`` for 4, 3 and 2 b/elem;
benchmarks/results/prerope_smollm2, 2026-12-03, same settings, mean of k-means seeds 0 and 1,
every key/value from codes): pq4-pre +2.0% (pq4-qa +2.7%), pq3-pre +12.6% (pq3-qa +13.6%),
pq2-pre +85.5% (pq2-r2-qa +35.6%, so ``--bits 2`` kept keys after RoPE until pq2-pre-g2, below;
pq2-pre-kv4, one M for keys and values, +115%). Codebooks of pre-RoPE keys from 512-token windows keep the key error
flat to 8K (0.18% -> 0.17%; post-RoPE 0.74% -> 29%) and lose +2.8% on 4096-token windows (pq4-qa
from the same windows: +536%). pq3-pre / pq2-pre are the RoPE-pair versions of pq3 / pq2.

With 4 exact sinks + 64 exact recent tokens (realistic/) plain pq4 (+0.2%) and pq2 (+2.2%)
came out slightly ahead of pq4-qa (+0.5%) and pq2-qa (+2.3%); the table is picked on the
all-from-codes protocol, the one issue 13's targets use.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from million_app.errors import UsageError
from million_app.progress import counting, status
from million_jax.calibration.fit import (DEFAULT_MAX_VECTORS, GROUPS_PER_FIT, codebook_groups, fit_kv_codebooks,
                                         fit_pair_key_centroids, fits_needed)
from million_jax.calibration.pair_bits import allocate_key_bits
from million_jax.calibration.finetune import FinetuneSettings, finetune_codebooks
from million_jax.quant.kv_transforms import output_value_transform, query_aware_key_transform, value_pca_transform
from million_jax.quant.kv_codebooks import PQCodebooks, unit_vectors
from million_jax.quant.pq import check_nbits
from models.decoder import rope_inv_freq

__all__ = ["Recipe", "RECIPES", "with_norms", "BEST_FOR_BITS", "FAMILY_BEST_FOR_BITS", "PRECISE_SINKS", "FAMILY_PRECISE_SINKS", "adopted_precise_sinks",
           "recipe_for_bits", "check_recipe_granularity", "fit_recipe"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    key_dsub: int
    key_nbits: int
    value_dsub: int
    value_nbits: int
    query_aware: bool = False
    output_aware: bool = False
    finetune_steps: int = 0
    finetune_reassign: int = 0
    stages: int = 1
    rope: str = "post"
    norms: bool = False
    unit: bool = False
    pair_widths: tuple[int, int] | None = None
    pair_order: bool = False
    value_pca: bool = False

    def __post_init__(self) -> None:
        def fail(what: str) -> None:
            raise UsageError(f"recipe {self.name!r}: {what}")

        if not isinstance(self.name, str) or not self.name:
            fail(f"name must be a non-empty string, got {self.name!r}")
        if self.rope not in ("pre", "post"):
            fail(f"rope must be 'pre' or 'post', got {self.rope!r}")
        for field in ("norms", "unit", "pair_order", "value_pca", "output_aware", "query_aware"):
            if not isinstance(getattr(self, field), bool):
                fail(f"{field} must be a bool, got {getattr(self, field)!r}")
        if self.unit and not self.norms:
            fail("unit codes need the norms stored (norms=True)")
        if self.norms and self.finetune_steps:
            fail("fine-tuning does not know about explicit norms: a recipe takes one or the other")
        for field, low in (("key_dsub", 1), ("value_dsub", 1), ("stages", 1), ("key_nbits", 1), ("value_nbits", 1),
                           ("finetune_steps", 0), ("finetune_reassign", 0)):
            x = getattr(self, field)
            if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < low:
                fail(f"{field} must be an integer >= {low}, got {x!r}")
        for field in ("key_nbits", "value_nbits"):
            try:
                check_nbits(getattr(self, field))
            except ValueError as e:
                fail(f"{field}: {e}")
        if self.pair_widths is not None:
            pw = self.pair_widths
            if (not isinstance(pw, tuple) or len(pw) != 2 or not all(isinstance(x, int) for x in pw)
                    or not pw[0] <= self.key_nbits <= pw[1] or pw[0] < 1 or pw[1] > 12):
                fail(f"pair_widths must be (lo, hi) ints with 1 <= lo <= key_nbits <= hi <= 12, got {pw!r}")
            if self.rope != "pre" or self.key_dsub != 2 or self.stages != 1 or self.query_aware or self.finetune_steps:
                fail("pair_widths needs keys before RoPE in 2-dim sub-spaces, one stage, no query-aware keys "
                     "and no fine-tuning")
        if self.pair_order and self.pair_widths is None:
            fail("pair_order orders each KV head's pairs into the widths of pair_widths: give pair_widths too")
        if self.value_pca and (self.output_aware or self.value_dsub != 2 or self.finetune_steps):
            fail("value_pca pairs principal axes of the values into 2-dim value sub-spaces: it needs "
                 "value_dsub=2, and takes the place of output_aware (one value transform); no fine-tuning")

    @property
    def finetune(self) -> FinetuneSettings | None:
        """The fine-tuning settings of this recipe (None: k-means only)."""
        if not self.finetune_steps:
            return None
        return FinetuneSettings(steps=self.finetune_steps, reassign_every=self.finetune_reassign)

    @property
    def bits_per_element(self) -> float:
        """Bits of the codes per element (norm-explicit recipes store 16 / head_dim more: ``stored_bits``)."""
        return self.stages * (self.key_nbits / self.key_dsub + self.value_nbits / self.value_dsub) / 2

    def stored_bits(self, head_dim: int) -> float:
        """Bits stored per element for ``head_dim``: the codes and the float16 norm scales."""
        return self.bits_per_element + (16 / head_dim if self.norms else 0.0)

    def describe(self) -> str:
        """One readable line: 'keys 2-dim sub-vectors x 8 bits, query-aware; values ...; 4.00 bits/elem'."""
        def part(what: str, dsub: int, nbits: int, transform: str | None) -> str:
            return f"{what} {dsub}-dim sub-vectors x {nbits} bits" + (f", {transform}" if transform else "")

        text = "; ".join((part("keys", self.key_dsub, self.key_nbits, "query-aware" if self.query_aware else None),
                          part("values", self.value_dsub, self.value_nbits,
                               "output-aware" if self.output_aware else
                               "in principal axes, widest paired with narrowest" if self.value_pca
                               else None)))
        text += f"; keys quantized {'before' if self.rope == 'pre' else 'after'} RoPE"
        if self.rope == "pre" and self.key_dsub > 2:
            text += f" ({self.key_dsub // 2} RoPE pairs per key sub-vector)"
        if self.stages > 1:
            text += f"; {self.stages} residual stages"
        if self.finetune_steps:
            text += f"; centroids fine-tuned {self.finetune_steps} steps"
        if self.norms:
            text += "; a float16 norm scale per key and value (+16 bits per vector)"
        if self.unit:
            text += ", codes of the unit vectors"
        if self.pair_widths is not None:
            text += (f"; key bits allocated across RoPE pairs ({self.pair_widths[0]}..{self.pair_widths[1]} bits, "
                     f"mean {self.key_nbits}{', each KV head ordering its pairs' if self.pair_order else ''})")
        return f"{text} ({self.bits_per_element:.2f} bits/elem{' of codes' if self.norms else ''})"

    def budgets(self, head_dim: int) -> dict[str, int]:
        """key / value M (per stage) and nbits for this head_dim (UsageError if a dsub does not divide it)."""
        for dsub in (self.key_dsub, self.value_dsub):
            if head_dim % dsub:
                raise UsageError(f"recipe {self.name}: sub-vectors of {dsub} dims do not divide head_dim {head_dim}")
        return dict(M=head_dim // self.key_dsub, nbits=self.key_nbits,
                    value_M=head_dim // self.value_dsub, value_nbits=self.value_nbits)


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("pq4", 2, 8, 2, 8),
    Recipe("pq4-qa", 2, 8, 2, 8, query_aware=True),
    Recipe("pq4-qa-ow", 2, 8, 2, 8, query_aware=True, output_aware=True),
    Recipe("pq4-qa-k3v5", 2, 6, 1, 5, query_aware=True),
    Recipe("pq3-qa", 2, 6, 2, 6, query_aware=True),
    Recipe("pq2", 4, 8, 4, 8),
    Recipe("pq2-qa", 4, 8, 4, 8, query_aware=True),
    Recipe("pq2-qa-ow", 4, 8, 4, 8, query_aware=True, output_aware=True),
    Recipe("pq2-qa-k1v3", 8, 8, 2, 6, query_aware=True),
    Recipe("pq1-qa", 8, 8, 8, 8, query_aware=True),
    # k-means, then 100 Adam steps per layer on the attention-output error
    Recipe("pq4-ft", 2, 8, 2, 8, finetune_steps=100),
    Recipe("pq4-qa-ft", 2, 8, 2, 8, query_aware=True, finetune_steps=100),
    Recipe("pq2-ft", 4, 8, 4, 8, finetune_steps=100),
    Recipe("pq2-qa-ft", 4, 8, 4, 8, query_aware=True, finetune_steps=100),
    # residual PQ: two (four) stages of wider sub-vectors at the same stored bits
    Recipe("pq4-r2", 4, 8, 4, 8, stages=2),
    Recipe("pq4-r2-qa", 4, 8, 4, 8, query_aware=True, stages=2),
    Recipe("pq4-r4-qa", 8, 8, 8, 8, query_aware=True, stages=4),
    Recipe("pq3-r2-qa", 4, 6, 4, 6, query_aware=True, stages=2),
    Recipe("pq2-r2-qa", 8, 8, 8, 8, query_aware=True, stages=2),
    # keys quantized before RoPE, one sub-space per RoPE pair (million_jax.rope)
    Recipe("pq4-pre", 2, 8, 2, 8, rope="pre"),
    Recipe("pq4-pre-ow", 2, 8, 2, 8, output_aware=True, rope="pre"),
    Recipe("pq3-pre", 2, 6, 2, 6, rope="pre"),
    Recipe("pq2-pre", 2, 4, 4, 8, rope="pre"),
    Recipe("pq2-pre-ow", 2, 4, 4, 8, output_aware=True, rope="pre"),
    Recipe("pq2-pre-kv4", 2, 4, 2, 4, rope="pre"),  # one M for keys and values: the kernel can read it
    # norm-explicit: the recipe's codebooks plus a float16 norm scale per key / value vector
    Recipe("pq4-pre-n", 2, 8, 2, 8, rope="pre", norms=True),
    Recipe("pq3-pre-n", 2, 6, 2, 6, rope="pre", norms=True),
    Recipe("pq3-pre-nu", 2, 6, 2, 6, rope="pre", norms=True, unit=True),
    Recipe("pq4-pre-nu", 2, 8, 2, 8, rope="pre", norms=True, unit=True),
    Recipe("pq2-pre-n", 2, 4, 4, 8, rope="pre", norms=True),
    Recipe("pq2-pre-nu", 2, 4, 4, 8, rope="pre", norms=True, unit=True),
    Recipe("pq2-r2-qa-n", 8, 8, 8, 8, query_aware=True, stages=2, norms=True),
    Recipe("pq2-r2-qa-nu", 8, 8, 8, 8, query_aware=True, stages=2, norms=True, unit=True),
    # keys before RoPE in sub-spaces of two RoPE pairs (m, m + d/4) x 8 bits: 256 centroids per
    # fast + slow pair instead of 16 per pair at the same 2 b/elem (benchmarks/pq2_pair_groups.py)
    Recipe("pq2-pre-g2", 4, 8, 4, 8, rope="pre"),
    Recipe("pq2-pre-g2-n", 4, 8, 4, 8, rope="pre", norms=True),
    Recipe("pq2-pre-g2-nu", 4, 8, 4, 8, rope="pre", norms=True, unit=True),
    # the same 4 b/elem of codes moved from values to keys (keys carry the 4 b loss on SmolLM2:
    # frontier/README.md (A1)); 2-dim sub-spaces, keys 9 / 10 bits, values 7 / 6 bits. Measured
    # 2026-12-07, not adopted: 9 / 7 ties pq4-pre-nu (+1.57 vs +1.60%, 32768 tokens, seeds 0 / 1),
    # 10 / 6 lost on both seeds (frontier/key_bits/README.md)
    Recipe("pq4-pre-nu-k4.5v3.5", 2, 9, 2, 7, rope="pre", norms=True, unit=True),
    Recipe("pq4-pre-nu-k5v3", 2, 10, 2, 6, rope="pre", norms=True, unit=True),
    # pq4-pre-nu with the keys' 8 bits per pair allocated across the RoPE pairs (6..10 bits, one
    # layout for the model, same 4.25 b/elem): `calibrate --bits 4` on 2026-12-07 until -po (below)
    Recipe("pq4-pre-nu-pa", 2, 8, 2, 8, rope="pre", norms=True, unit=True, pair_widths=(6, 10)),
    # the same, with one width per key sub-space and each (layer, KV head) putting its own pairs into
    # them (PQCodebooks.key_pair_order): the per-head freedom at the cost of a frequency per head;
    # `calibrate --bits 4` since 2026-12-07 (BEST_FOR_BITS)
    Recipe("pq4-pre-nu-po", 2, 8, 2, 8, rope="pre", norms=True, unit=True, pair_widths=(6, 10), pair_order=True),
    # the same, values coded in a paired principal basis per (layer, KV head)
    # (million_jax.quant.kv_transforms.value_pca_transform). Measured 2026-12-07, not adopted: -0.1
    # point of perplexity, but the needle grid loses (frontier/key_bits/README.md (6))
    Recipe("pq4-pre-nu-po-vp", 2, 8, 2, 8, rope="pre", norms=True, unit=True, pair_widths=(6, 10), pair_order=True,
           value_pca=True),
)}

# key_rope -> bits per element -> recipe name, the measured best per budget (module docstring,
# benchmarks/results/recipes_smollm2 and prerope_smollm2)
# Norm-explicit recipes (+16 bits per key / value vector) are adopted where they won on both
# k-means seeds with every key/value from codes, against the same recipe without norms
# (benchmarks/results/frontier/norm_explicit/README.md, 2026-12-05, same codebook files):
#   SmolLM2 2 b  pq2-r2-qa +36.7 / +39.2%  -> -n +23.7 / +28.6%  -> -nu +23.5 / +23.0%  (2.25 b/elem)
#   SmolLM2 3 b  pq3-pre   +10.4 / +11.9%  -> -n  +8.1 / +10.6%  -> -nu  +6.8 /  +5.8%  (3.25 b/elem)
#   SmolLM2 4 b  pq4-pre    +2.4 /  +1.0%  -> -n  +2.5 /  +1.5%  -> -nu  +1.8 /  +1.0%  (mixed on ppl;
#                -nu adopted 2026-12-06 for the needle: 8K, 100% depth, 3 keys, log p(key) below dense
#                1.56 / 1.41 nats with pq4-pre, 0.83 / 0.72 with -nu, seeds 0 / 1; 4.25 b/elem;
#                norm_explicit/README.md "Needle")
# "-n" rescales today's codebooks' reconstructions to the stored norm; "-nu" fits the codebooks on
# unit vectors and encodes x / |x| (NEQ). Gemma 3 (its 4 sinks kept) prefers "-n": see
# FAMILY_BEST_FOR_BITS.
# Keys before RoPE in 4-dim sub-spaces of two RoPE pairs (m, m + d/4) x 8 bits at 2 b/elem
# (benchmarks/results/frontier/pair_groups/README.md, 2026-12-06, seeds 0 / 1, every token from codes):
#   SmolLM2 pq2-pre-g2 +22.0 / +20.7% (2.00 b/elem; pq2-r2-qa +36.7 / +39.2%), -n +19.7 / +17.9%,
#   -nu +14.0 / +14.5% (2.25 b; pq2-r2-qa-nu +23.5 / +23.0%): pq2-pre-g2-nu, and --bits 2 now keeps
#   keys before RoPE (only --bits 1 stays after it).
# Key bits allocated across RoPE pairs at 4 b/elem (benchmarks/results/frontier/key_bits/README.md (4),
# 2026-12-07; SmolLM2, 32768 tokens of builtin:eval, dense 12.701, every key/value from codes, both
# recipes fitted in one process per seed):
#   pq4-pre-nu +1.79 / +1.40%  -> pq4-pre-nu-pa +1.13 / +1.18%  (4.25 b/elem; one layout for the model,
#   K5x6+9x7+2x8+1x7+5x8+10x10 on both seeds); needle at 8K, 100% depth, 3 keys, teacher-forced
#   log p(key): dense -1.66, pq4-pre-nu -2.48 / -2.38, pq4-pre-nu-pa -1.68 / -1.38 (seeds 0 / 1;
#   greedily found 2/3 and 3/3 where dense and pq4-pre-nu find 0/3).
#   The fit takes ~4-6x longer (key codebooks of 6, 7, 9 and 10 bits).
#   pq4-pre-nu-po (the same widths shared by the model, each (layer, KV head) placing its own pairs
#   in them, key_bits/README.md (5)): +1.03 / +0.92% (mean +0.98%; pa +1.13 / +1.18% in the same
#   setting, fitted in separate processes), layout K5x6+9x7+7x8+3x9+8x10 on both seeds, 4.25 b/elem;
#   needle log p(key) -1.34 / -1.71, found 3/3 and 1/3 (pa -1.68 / -1.38, 2/3 and 3/3; the same
#   mean log p): adopted for the perplexity, which it wins on both seeds.
BEST_FOR_BITS: dict[str, dict[int, str]] = {
    "post": {4: "pq4-qa", 3: "pq3-qa", 2: "pq2-r2-qa-nu", 1: "pq1-qa"},
    "pre": {4: "pq4-pre-nu-po", 3: "pq3-pre-nu", 2: "pq2-pre-g2-nu"},
}

# model family -> key_rope -> bits -> recipe, where a family measured another best than BEST_FOR_BITS.
# Gemma 3 270M, keys before RoPE, 4 precise sinks, every other key/value from codes (same files):
#   2 b  pq2-pre +7.36 / +6.81%  -> -n +5.23 / +5.44%  -> -nu +5.36 / +6.13%  (2.06 b/elem)
#   3 b  pq3-pre +1.88 / +1.28%  -> -n +1.66 / +1.08%  -> -nu +1.82 / +1.59%  (3.06 b/elem)
#   4 b  pq4-pre +0.19 / +0.56%  -> -n +0.05 / +0.74%  -> -nu +0.35 / +0.34%  (a tie on perplexity;
#        -n adopted 2026-12-06 for the needle: at 32K, 3 keys at 50% depth, teacher-forced log p(key)
#        loses 0.64 / 0.45 / 0.69 / 0.54 nats to dense with pq4-pre and 0.32 / 0.41 / 0.46 / 0.02 with
#        -n, k-means seeds 0-3; frontier/gemma3/README.md "Norm-explicit at 4 b, adopted")
#   2 b  two RoPE pairs per key sub-space (pair_groups/README.md): pq2-pre-g2-n +2.76 / +2.44%,
#        -nu +3.15 / +3.36% (2.06 b/elem): pq2-pre-g2-n
FAMILY_BEST_FOR_BITS: dict[str, dict[str, dict[int, str]]] = {
    "gemma3": {"pre": {4: "pq4-pre-n", 3: "pq3-pre-n", 2: "pq2-pre-g2-n"}},
}

# recipe name -> exact first tokens recorded in the codebook file (`calibrate --bits B`; `eval`
# keeps them in the cache dtype under both protocols, a fixed cost per sequence), adopted where
# measured to win on both k-means seeds (benchmarks/results/frontier/README.md, "The first rows at
# higher precision"): at 2 b/elem 4 bf16 sinks take every-token-from-codes SmolLM2 from +36.7% /
# +39.2% to +32.0% / +30.0%; at 4 b/elem (pq4-pre) they won on one seed and lost on the other.
# With the norm-explicit pq2-r2-qa-n they won on seed 1 (+28.6% -> +24.4%) and lost on seed 0
# (+23.7% -> +26.3%; norm_explicit/README.md): not adopted there, nor (unmeasured) for pq2-r2-qa-nu.
PRECISE_SINKS: dict[str, int] = {"pq2-r2-qa": 4}

# model family -> exact first tokens at every --bits (taken over PRECISE_SINKS when larger). Gemma 3
# 270M (benchmarks/results/frontier/gemma3/README.md, "4 precise sinks at every budget"): every
# key/value of the global layers from codes, dense 12.421, mean of k-means seeds 0 / 1, 4 bf16 sinks
# take pq4 from +10.7% to +0.4%, pq3 from +14.1% to +1.6%, pq2 from +29.7% to +7.1% (both seeds win
# at every budget); they cost 12 KiB per sequence. The BOS / sink token's key is what Gemma's
# codebooks reproduce worst.
FAMILY_PRECISE_SINKS: dict[str, int] = {"gemma3": 4}


def with_norms(recipe: Recipe, norms: bool, unit: bool = False) -> Recipe:
    """``recipe`` with these norm settings: the named recipe of ``RECIPES`` that has them (so its
    name and measured precise sinks follow), else a copy named ``<recipe>+norms`` / ``+unit`` /
    ``-norms``."""
    want = dataclasses.replace(recipe, name="?", norms=norms, unit=unit)
    for r in RECIPES.values():
        if dataclasses.replace(r, name="?") == want:
            return r
    suffix = "+unit" if unit else "+norms" if norms else "-norms"
    return dataclasses.replace(want, name=recipe.name + suffix)


def adopted_precise_sinks(recipe: Recipe | None, family: str) -> int:
    """Exact first tokens ``calibrate`` records for ``recipe`` (``--bits B``; None for an ``--M`` /
    ``--nbits`` fit) on a model of ``family``: the family's measured count (a property of the
    model's first tokens, so it holds for any codebooks), or the recipe's where larger."""
    family_sinks = FAMILY_PRECISE_SINKS.get(family, 0)
    if recipe is None:
        return family_sinks
    return max(PRECISE_SINKS.get(recipe.name, 0), family_sinks)


def recipe_for_bits(bits: int, key_rope: str = "pre", family: str | None = None) -> Recipe:
    """The recipe for ``--bits`` with keys quantized ``key_rope`` RoPE on a model of ``family``
    (its entry of ``FAMILY_BEST_FOR_BITS`` if any, else ``BEST_FOR_BITS``; UsageError for a budget
    without one)."""
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool):
        raise UsageError(f"--bits must be an integer, got {bits!r}")
    table = BEST_FOR_BITS.get(key_rope)
    if table is None:
        raise UsageError(f"--rope must be one of {sorted(BEST_FOR_BITS)}, got {key_rope!r}")
    if bits not in table:
        other = [r for r, t in BEST_FOR_BITS.items() if bits in t and r != key_rope]
        hint = f" (--rope {other[0]} has one)" if other else ""
        raise UsageError(f"--bits with --rope {key_rope} must be one of {sorted(table)}, got {bits}{hint}")
    return RECIPES[FAMILY_BEST_FOR_BITS.get(family, {}).get(key_rope, {}).get(bits, table[bits])]


def _check_calibration_arrays(recipe: Recipe, c, k, v, q_gram, q_count) -> None:
    """UsageError unless k, v are float[L, Hkv, N, d] of this model (same N >= 1) and, for a
    query-aware recipe, q_gram float[L, Hkv, d, d] and q_count [L, Hkv]."""
    lhd = (c.n_global_layers, c.n_kv_heads)
    want = f"[{c.n_global_layers}, {c.n_kv_heads}, N, {c.head_dim}] (layers, KV heads, tokens, head_dim)"
    for name, a in (("k", k), ("v", v)):
        shape = tuple(np.shape(a))
        if len(shape) != 4 or shape[:2] != lhd or shape[3] != c.head_dim or shape[2] < 1:
            raise UsageError(f"recipe {recipe.name}: calibration {name} must be {want}, got {list(shape)}")
    if np.shape(k) != np.shape(v):
        raise UsageError(f"recipe {recipe.name}: calibration k {list(np.shape(k))} and v {list(np.shape(v))} differ")
    if recipe.query_aware or recipe.pair_widths is not None:
        for name, a, shape in (("q_gram", q_gram, lhd + (c.head_dim, c.head_dim)), ("q_count", q_count, lhd)):
            if a is None or tuple(np.shape(a)) != shape:
                raise UsageError(f"recipe {recipe.name}: {name} must have shape {list(shape)} for this model, got "
                                 f"{None if a is None else list(np.shape(a))}")


PAIR_ERROR_SAMPLE = 4096  # calibration keys per (layer, KV head) that rank the widths of the RoPE pairs


def _allocate_pair_bits(recipe: Recipe, books: PQCodebooks, k: np.ndarray, q_gram, q_count, *, granularity: str,
                        seed: int, iters: int, max_vectors: int, report_to: dict | None = None) -> PQCodebooks:
    """``books`` with the keys' bits allocated across RoPE pairs (``Recipe.pair_widths``): key
    codebooks of the other widths fitted on the same keys ``k`` float32[L, Hkv, N, d] (pre-RoPE, not
    normalised), ranked on a sample of them (:func:`million_jax.calibration.pair_bits.allocate_key_bits`).
    ``report_to``: a dict that gets the widths per pair and the weighted key error vs uniform widths."""
    lo, hi = recipe.pair_widths
    groups = codebook_groups(granularity, *k.shape[:2])
    pool = k.shape[0] * k.shape[1] * k.shape[2] // groups  # calibration vectors per codebook
    fits = int(np.log2(min(max_vectors, pool)))  # the widest codebook the samples can fit (>= key_nbits: fitted)
    if fits < hi:
        status(f"recipe {recipe.name}: key widths capped at {fits} bits (of {hi}): {min(max_vectors, pool)} "
               "calibration vectors per codebook")
        hi = fits
    others = [w for w in range(lo, hi + 1) if w != recipe.key_nbits]
    fit_keys = unit_vectors(k) if recipe.unit else k
    by_width = {}
    total, done = len(others) * fits_needed(groups, GROUPS_PER_FIT), [0]
    with counting(f"key codebooks of {', '.join(map(str, others))} bits ({recipe.name})", "fit") as report:
        def step() -> None:
            done[0] += 1
            report(done[0], total)

        for w in others:
            by_width[w] = fit_pair_key_centroids(fit_keys, w, granularity=granularity,
                                                 key=jax.random.fold_in(jax.random.PRNGKey(seed), 1000 + w),
                                                 max_vectors=max_vectors, iters=iters, progress=step)
    pick = np.sort(np.random.default_rng(seed).choice(k.shape[2], min(PAIR_ERROR_SAMPLE, k.shape[2]), replace=False))
    out, summary = allocate_key_bits(books, by_width, k[:, :, pick], q_gram, q_count, per_head_order=recipe.pair_order)
    if report_to is not None:
        widths = "key_bits_per_subspace" if recipe.pair_order else "key_bits_per_pair"
        report_to.update({widths: summary[widths], "pair_score_error_vs_uniform": summary["score_error_vs_uniform"]})
    return out


def check_recipe_granularity(recipe: Recipe, config, granularity: str) -> None:
    """UsageError when ``recipe`` cannot be fitted at ``granularity`` on a model of ``config``: a
    per-head pair order (``pair_order``) needs codebooks per layer and KV head."""
    if recipe.pair_order and codebook_groups(granularity, config.n_global_layers, config.n_kv_heads) != \
            config.n_global_layers * config.n_kv_heads:
        raise UsageError(f"recipe {recipe.name}: a pair order per layer and KV head needs codebooks per layer and "
                         f"KV head (granularity layer_head, or layer with one KV head), got {granularity}")


def _value_transform(recipe: Recipe, model, v: np.ndarray) -> np.ndarray | None:
    """The one value transform of ``recipe`` (they exclude each other, :class:`Recipe`): the
    output-aware B float32[L, Hkv, d, d] from the model's ``wo``, the principal axes of the values
    ``v`` float32[L, Hkv, N, d] as the codebooks code them (unit vectors for a ``unit`` recipe), or None."""
    if recipe.output_aware:
        c = model.config
        wo = np.asarray(model.params["layers"]["wo"], np.float32)[list(c.global_layers)]
        return output_value_transform(wo, c.n_heads, c.n_kv_heads)
    if recipe.value_pca:
        return value_pca_transform(v)
    return None


def fit_recipe(recipe: Recipe, model, k: np.ndarray, v: np.ndarray, q_gram: np.ndarray, q_count: np.ndarray, *,
               granularity: str = "layer_head", seed: int = 0, iters: int = 25,
               max_vectors: int = DEFAULT_MAX_VECTORS, queries: tuple | None = None,
               finetune_report: list | None = None, allocation_report: dict | None = None) -> PQCodebooks:
    """Codebooks of ``recipe`` from calibration K/V float32[L, Hkv, N, d] and the query Gram sums
    float[L, Hkv, d, d] / counts [L, Hkv] (``million_app.calibrate.calibration_kvq``).

    A recipe with ``finetune_steps`` also needs ``queries = (q, q_pos, window)``: query samples
    float32[L, Hkv, G, Nq, d], their token indices int[Nq] into the N calibration tokens and the
    window length (``million_app.calibrate.calibration_kvq_samples``). A ``rope="pre"`` recipe
    needs ``k`` collected before RoPE (``calibration_kvq(..., key_rope="pre")``). The per-layer
    ``LayerFinetune`` reports are appended to ``finetune_report`` when it is a list. A recipe with
    ``pair_widths`` puts its widths per RoPE pair and their weighted key error vs uniform widths into
    ``allocation_report`` when it is a dict."""
    c = model.config
    _check_calibration_arrays(recipe, c, k, v, q_gram, q_count)
    check_recipe_granularity(recipe, c, granularity)  # before the fits, not after them
    kt = query_aware_key_transform(q_gram, q_count) if recipe.query_aware else None
    ft = recipe.finetune
    if ft is not None and queries is None:
        raise UsageError(f"recipe {recipe.name} fine-tunes its codebooks and needs calibration query samples "
                         "(million_app.calibrate.calibration_kvq_samples)")
    if recipe.rope == "pre" and ft is not None:
        raise UsageError(f"recipe {recipe.name}: fine-tuning is not implemented for keys quantized before RoPE")
    inv_freq = rope_inv_freq(c) if recipe.rope == "pre" else None
    k_raw = k
    try:
        with counting(f"k-means ({recipe.name})", "fit") as report:
            if recipe.unit:  # NEQ: the codebooks code directions, the stored scale the norm
                k, v = unit_vectors(k), unit_vectors(v)
            vt = _value_transform(recipe, model, v)
            books = fit_kv_codebooks(k, v, **recipe.budgets(c.head_dim), granularity=granularity,
                                     key=jax.random.PRNGKey(seed), max_vectors=max_vectors, iters=iters,
                                     key_transform=kt, value_transform=vt, stages=recipe.stages,
                                     rope_inv_freq=inv_freq, progress=report)
        if recipe.norms:
            books = books.with_explicit_norms(True, True, recipe.unit)
        if recipe.pair_widths is not None:
            books = _allocate_pair_bits(recipe, books, k_raw, q_gram, q_count, granularity=granularity, seed=seed,
                                        iters=iters, max_vectors=max_vectors, report_to=allocation_report)
        if ft is None:
            return books
        q, q_pos, window = queries
        with counting(f"fine-tuning ({recipe.name})", "layer") as report:
            books, reports = finetune_codebooks(books, q, k, v, q_pos, window=window, settings=ft,
                                                key=jax.random.fold_in(jax.random.PRNGKey(seed), 1),
                                                progress=report)
    except ValueError as e:
        raise UsageError(f"recipe {recipe.name}: {e}") from None
    if finetune_report is not None:
        finetune_report.extend(reports)
    return books
