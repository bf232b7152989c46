"""End-to-end long-context decoding on one GPU: PQ KV cache vs bf16 KV cache, and GPU k-means.

MILLION's headline experiment, in our JAX model, in one call on a lent H200 (installs
nothing, reads nothing from the network):

  * models: a LLaMA-2-7B-shaped decoder (32 layers, 32 q / 32 kv heads, d 128) and a
    LLaMA-3.1-8B-shaped one (32 / 8, GQA), random bf16 weights generated on the device;
  * caches: the preallocated, donated bf16 ``DenseCache`` (the baseline) and the ``PQCache``
    (M=64, nbits=8: 4 bits / element, no exact window or sinks by default) with layer_head
    codebooks from a quick k-means on the model's own post-RoPE K/V (a short random-token
    prompt prefilled into a DenseCache -> ``collect_kv`` -> ``fit_kv_codebooks``);
  * grid: batch 1 and 8 x contexts 4K, 16K, 32K, 64K, ordered so the headline rows (batch 1
    at 32K and 4K, both models) run first;
  * the project's k-means (``million_jax.pq.fit_codebooks``) on 1M vectors, d=128, M=64,
    nbits=8, 25 iterations.

Per row (model, batch, context, cache):
  fill     "prefill": the context (random tokens) is run through the model by a jitted
           ``lax.fori_loop`` of chunked ``models.prefill`` calls, cache donated; timed once
           (``prefill_seconds``; for PQ this includes encoding every token). Used for batch 1
           up to 32K by default. "synthetic": the cache is created already holding
           ``context`` tokens of hashed pseudo-random K/V (bf16) or codes (PQ); decode time
           does not depend on the values, and this keeps the O(T^2) jnp prefill of long or
           batched contexts out of the time budget. ``prefill_seconds`` is then null.
  decode   ``ms_per_token``: ``models.generate`` (inside one jit, cache donated) continuing
           the filled cache with a 1-token prompt for N new tokens: one t=1 prefill step plus
           N-1 steps of the ``lax.while_loop``, i.e. N forward passes; wall time / N, median
           of ``--repeats`` calls after one warm-up call (compiled ahead, so no compile time
           is included). EOS is disabled so every call makes exactly N tokens.
  memory   ``peak_bytes``: the compiled decode program's memory analysis (arguments +
           outputs + temporaries - donated aliases: weights + cache + scratch). JAX cannot
           reset the allocator's ``peak_bytes_in_use``, so that is recorded only as the
           process-wide running maximum (``process_peak_bytes_in_use``), next to the live
           ``bytes_in_use`` right after the fill. A row whose compiled programs would not fit
           in the free device memory is recorded as "oom" without allocating anything; a
           RESOURCE_EXHAUSTED at run time is caught and recorded the same way.
  impl     PQ decode uses the Pallas kernel on GPU when it supports the shapes (what
           ``impl="auto"`` does); if it fails to compile or run, the row is redone with
           ``impl="xla"`` (recorded in ``impl`` / ``impl_note``) and later rows use xla.

A global time guard (``--budget-s``) stops starting new work when the estimated cost of the
next step would overrun, records the rest as "skipped", and still writes the results. The
JSON and markdown are rewritten after every row, so a run cut short leaves what it had.

Outputs: <out>/gpu_e2e_<date>.json (a list of row dicts; ``kind`` is "env", "model",
"kmeans" or "decode"; every row carries model, context, batch, cache, ms_per_token, speedup,
peak_bytes, prefill_seconds, impl, device) and <out>/gpu_e2e_<date>.md (tables and a "where
the time goes" section computed from the measured numbers and a measured copy bandwidth).

  python benchmarks/gpu_e2e.py --out DIR           # full grid, about 8 min on an H200
  python benchmarks/gpu_e2e.py --quick --out DIR   # contexts 4K + 32K, fewer tokens
  python benchmarks/gpu_e2e.py --tiny --out DIR    # CPU smoke test, tiny models (< 1 min)
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # the time guard counts from here (imports included)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

# JAX preallocates 75% of GPU memory by default; the long-context rows need more.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from million_jax.cache.dense import DenseCache  # noqa: E402
from million_jax.cache.pq_cache import PQCache, PQCodebooks  # noqa: E402
from million_jax.calibration import collect_kv, fit_kv_codebooks  # noqa: E402
from million_jax.pq import encode, decode, fit_codebooks  # noqa: E402
from models import LlamaConfig, generate, init_params, prefill, preset  # noqa: E402

GiB = 2**30

# Every row carries these keys (None where they do not apply).
ROW_KEYS = ("kind", "model", "context", "batch", "cache", "status", "ms_per_token", "speedup",
            "peak_bytes", "prefill_seconds", "impl", "device")


# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a run needs, resolved from the command line (see ``parse_args``)."""

    tiny: bool
    models: tuple[str, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    new_tokens: int
    repeats: int
    M: int
    nbits: int
    window: int
    sinks: int
    pq_impl: str
    dtype: str  # weights and full-precision caches: bfloat16 (float32 for --tiny on CPU)
    prefill_batches: tuple[int, ...]
    prefill_max_context: int
    prefill_score_bytes: int
    calib_tokens: int
    calib_iters: int
    calib_chunk: int
    kmeans_vectors: int
    kmeans_dim: int
    kmeans_M: int
    kmeans_nbits: int
    kmeans_iters: int
    skip_kmeans: bool
    budget_s: float
    assume_device_bytes: int | None
    out: str
    stamp: str
    fail_pallas: bool  # test hook: pretend the Pallas kernel fails at compile time
    plan_only: bool


def model_configs(tiny: bool) -> dict[str, LlamaConfig]:
    """The model shapes by name (random weights; only the shapes matter here)."""
    if tiny:
        return {"tiny-mha": preset("tiny").replace(n_kv_heads=4), "tiny-gqa": preset("tiny")}
    return {"llama2-7b": preset("llama2-7b"), "llama3.1-8b": preset("llama3.1-8b")}


def parse_args(argv: list[str] | None) -> Settings:
    """Command line -> Settings (defaults depend on --tiny / --quick)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (smoke test)")
    p.add_argument("--quick", action="store_true", help="reduced grid: contexts 4K + 32K, N=8")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--models", nargs="*", default=None, help="subset of model names")
    p.add_argument("--contexts", type=int, nargs="*", default=None)
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--new-tokens", type=int, default=None, help="N tokens per timed generate call")
    p.add_argument("--repeats", type=int, default=None, help="timed generate calls per row")
    p.add_argument("--M", type=int, default=None, help="PQ subspaces (default d/2)")
    p.add_argument("--nbits", type=int, default=None, help="PQ bits per code (default 8; 6 with --tiny)")
    p.add_argument("--window", type=int, default=0, help="PQCache exact recent-token window")
    p.add_argument("--sinks", type=int, default=0, help="PQCache exact sink tokens")
    p.add_argument("--pq-impl", default="auto", choices=["auto", "pallas", "xla"])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights and bf16-cache dtype (default bfloat16; float32 with --tiny, since "
                        "XLA:CPU rejects the dense cache's batched bf16 x bf16 -> f32 dots at batch > 1)")
    p.add_argument("--prefill-batches", type=int, nargs="*", default=None,
                   help="batches whose rows are filled by a real (timed) prefill")
    p.add_argument("--prefill-max-context", type=int, default=None,
                   help="longest context filled by a real prefill (longer: synthetic fill)")
    p.add_argument("--prefill-score-gib", type=float, default=6.0,
                   help="bound on one chunk's fp32 score tensor; sets the prefill chunk size")
    p.add_argument("--calib-tokens", type=int, default=None)
    p.add_argument("--calib-iters", type=int, default=None)
    p.add_argument("--kmeans-vectors", type=int, default=None)
    p.add_argument("--skip-kmeans", action="store_true")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new work past this many seconds from start")
    p.add_argument("--assume-device-bytes", type=int, default=None,
                   help="device memory limit for the OOM prediction (default: memory_stats)")
    p.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache dir")
    p.add_argument("--plan", action="store_true",
                   help="print the ordered work items with cache sizes and exit (runs nothing)")
    p.add_argument("--fail-pallas", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
    names = model_configs(a.tiny)
    models = tuple(a.models) if a.models else (("tiny-gqa",) if a.tiny else tuple(names))
    unknown = [m for m in models if m not in names]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(names)}")
    head_dim = names[models[0]].head_dim
    if a.tiny:
        dflt = dict(contexts=(64,), batches=(1, 2), new_tokens=4, repeats=2, prefill_batches=(1,),
                    prefill_max_context=1 << 30, calib_tokens=64, calib_iters=2, calib_chunk=64,
                    kmeans=(4096, 16, 8, 6, 2), budget=300.0, nbits=6, dtype="float32")
    elif a.quick:
        dflt = dict(contexts=(4096, 32768), batches=(1, 8), new_tokens=8, repeats=2,
                    prefill_batches=(1,), prefill_max_context=4096, calib_tokens=1024,
                    calib_iters=4, calib_chunk=32, kmeans=(1 << 20, 128, 64, 8, 25), budget=300.0)
    else:
        dflt = dict(contexts=(4096, 16384, 32768, 65536), batches=(1, 8), new_tokens=16,
                    repeats=3, prefill_batches=(1,), prefill_max_context=32768,
                    calib_tokens=1024, calib_iters=4, calib_chunk=32,
                    kmeans=(1 << 20, 128, 64, 8, 25), budget=480.0)
    km = dflt["kmeans"]
    return Settings(
        tiny=a.tiny,
        models=models,
        contexts=tuple(a.contexts or dflt["contexts"]),
        batches=tuple(a.batches or dflt["batches"]),
        new_tokens=a.new_tokens or dflt["new_tokens"],
        repeats=a.repeats or dflt["repeats"],
        M=a.M or head_dim // 2,
        nbits=a.nbits or dflt.get("nbits", 8),
        window=a.window,
        sinks=a.sinks,
        pq_impl=a.pq_impl,
        dtype=a.dtype or dflt.get("dtype", "bfloat16"),
        prefill_batches=tuple(dflt["prefill_batches"] if a.prefill_batches is None else a.prefill_batches),
        prefill_max_context=(dflt["prefill_max_context"] if a.prefill_max_context is None
                             else a.prefill_max_context),
        prefill_score_bytes=int(a.prefill_score_gib * GiB),
        calib_tokens=a.calib_tokens or dflt["calib_tokens"],
        calib_iters=a.calib_iters or dflt["calib_iters"],
        calib_chunk=dflt["calib_chunk"],
        kmeans_vectors=a.kmeans_vectors or km[0],
        kmeans_dim=km[1],
        kmeans_M=km[2],
        kmeans_nbits=km[3],
        kmeans_iters=km[4],
        skip_kmeans=a.skip_kmeans,
        budget_s=dflt["budget"] if a.budget_s is None else a.budget_s,
        assume_device_bytes=a.assume_device_bytes,
        out=a.out,
        stamp=datetime.datetime.now().strftime("%Y-%m-%d"),
        fail_pallas=a.fail_pallas,
        plan_only=a.plan,
    )


# ----------------------------------------------------------------------------- device + clock


class Budget:
    """Wall-clock guard: ``allows(estimate)`` is False once the estimate would overrun."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    @staticmethod
    def elapsed() -> float:
        return time.monotonic() - _T0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, estimate_s: float) -> bool:
        return self.left() > estimate_s


def device_info() -> dict[str, Any]:
    """Device kind, platform, versions and the memory the allocator manages."""
    dev = jax.devices()[0]
    stats = _memory_stats()
    import jaxlib

    return dict(device=dev.device_kind, platform=dev.platform, num_devices=jax.device_count(),
                jax=jax.__version__, jaxlib=getattr(jaxlib, "__version__", "?"),
                bytes_limit=None if stats is None else stats.get("bytes_limit"),
                mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))


def _memory_stats() -> dict[str, int] | None:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has allocator stats
        return None


def copy_bandwidth(tiny: bool) -> float:
    """Bytes (read + written) per second of x -> x + 1 over a large uint32 array."""
    n = (1 << 16) if tiny else (1 << 30)  # 4 GiB on the GPU
    x = jnp.zeros((n,), jnp.uint32)
    f = jax.jit(lambda a: a + 1)
    x = jax.block_until_ready(f(x))
    reps = 2 if tiny else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        x = f(x)
    jax.block_until_ready(x)
    dt = time.perf_counter() - t0
    del x
    return 2 * n * 4 * reps / dt


def is_oom(e: BaseException) -> bool:
    """True for allocator exhaustion (XLA's RESOURCE_EXHAUSTED / out of memory)."""
    s = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower() or "Out of memory" in s


def short_error(e: BaseException, n: int = 400) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:n]


def tree_bytes(tree: Any) -> int:
    """Bytes of all array leaves (arrays or ShapeDtypeStructs)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- compiled programs


@dataclasses.dataclass
class Program:
    """An ahead-of-time compiled function with its compile time and memory analysis."""

    compiled: Any
    compile_seconds: float
    peak_bytes: int | None  # arguments + outputs + temporaries - aliases
    memory: dict[str, int]
    hlo_text: Callable[[], str]

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)


def compile_program(fn: Callable[..., Any], *args: Any) -> Program:
    """Lower and compile ``fn`` (a jitted function) for ``args`` (arrays or ShapeDtypeStructs)."""
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    dt = time.perf_counter() - t0
    memory: dict[str, int] = {}
    peak = None
    try:
        m = compiled.memory_analysis()
        if m is not None:
            for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                      "alias_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes"):
                if hasattr(m, k):
                    memory[k] = int(getattr(m, k))
            peak = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                    + memory["temp_size_in_bytes"] - memory["alias_size_in_bytes"])
    except Exception:  # noqa: BLE001 - memory analysis is optional
        pass
    return Program(compiled, dt, peak, memory, compiled.as_text)


def make_prefill_fn(config: LlamaConfig, chunk: int) -> Callable[..., Any]:
    """jit(params, cache, tokens int[B, T], consts) -> (last logits, cache): chunked prefill.

    T / chunk calls of ``models.prefill`` in a ``lax.fori_loop`` (one compiled program, the
    cache donated and carried in place).
    """

    def run(params, cache, tokens, consts):
        b, t = tokens.shape
        lens = jnp.full((b,), chunk, jnp.int32)

        def body(i, carry):
            cache, _ = carry
            toks = jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1)
            logits, cache = prefill(config, params, cache, toks, lens, consts, last_only=True)
            return cache, logits

        init = (cache, jnp.zeros((b, config.vocab), jnp.float32))
        cache, logits = jax.lax.fori_loop(0, t // chunk, body, init)
        return logits, cache

    return jax.jit(run, donate_argnums=(1,))


def make_generate_fn(config: LlamaConfig, new_tokens: int) -> Callable[..., Any]:
    """jit(params, cache, token int[B], consts) -> (tokens, num_generated, cache).

    ``models.generate`` continuing the cache with a 1-token prompt, EOS disabled: N forward
    passes (the prompt step + N-1 while_loop steps). The cache is donated.
    """

    def run(params, cache, token, consts):
        b = token.shape[0]
        res = generate(config, params, cache, token[:, None], jnp.ones((b,), jnp.int32),
                       max_new_tokens=new_tokens, eos_id=(), cache_consts=consts)
        return res.tokens, res.num_generated, res.cache

    return jax.jit(run, donate_argnums=(1,))


def _hash_bits(shape: tuple[int, ...], seed: int) -> jax.Array:
    """uint32 pseudo-random bits from element coordinates (cheap: one fused elementwise pass)."""
    primes = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C)
    h = jnp.full(shape, (seed * 0x61C88647 + 1) & 0xFFFFFFFF, jnp.uint32)
    for ax in range(len(shape)):
        h = h + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(primes[ax % len(primes)])
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def make_synthetic_fn(make_empty: Callable[[], Any], length: int, nbits: int = 8) -> Callable[[], Any]:
    """jit() -> a cache that already holds ``length`` tokens of pseudo-random K/V or codes.

    Codes are uniform in [0, 2**nbits); bf16 values uniform in [-2, 2). Slots past ``length``
    hold the same pseudo-random data (never read as tokens).
    """

    def run():
        cache = make_empty()
        lengths = jnp.full(cache.lengths.shape, length, jnp.int32)
        if isinstance(cache, DenseCache):
            def vals(x, seed):
                u = (_hash_bits(x.shape, seed) >> 16).astype(jnp.float32) * (4.0 / 65536.0) - 2.0
                return u.astype(x.dtype)

            return DenseCache(k=vals(cache.k, 1), v=vals(cache.v, 2), lengths=lengths)
        shift = jnp.uint32(32 - nbits)  # top bits: codes in [0, 2**nbits)
        k_codes = (_hash_bits(cache.k_codes.shape, 3) >> shift).astype(cache.k_codes.dtype)
        v_codes = (_hash_bits(cache.v_codes.shape, 4) >> shift).astype(cache.v_codes.dtype)
        return dataclasses.replace(cache, k_codes=k_codes, v_codes=v_codes, lengths=lengths)

    return jax.jit(run)


PQ_PREFILL_TILE = 512  # keys per step of the xla PQ attention (million_jax.pq_attention's tile)


def prefill_chunk(batch: int, context: int, keys: int, n_heads: int, score_bytes: int) -> int:
    """Largest power-of-two chunk (<= 2048) dividing ``context`` whose fp32 scores fit.

    ``keys``: keys scored at once per query: T_max for the dense cache (its attention masks the
    whole preallocated cache), the tile size for PQ (an online softmax over code tiles).
    """
    chunk = min(2048, context & -context)
    while chunk > 16 and batch * n_heads * chunk * keys * 4 > score_bytes:
        chunk //= 2
    return chunk


# ----------------------------------------------------------------------------- bytes model


def param_bytes(config: LlamaConfig, dtype_bytes: int = 2) -> int:
    """Bytes of all weights."""
    c = config
    qd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = 2 * c.hidden + c.hidden * (qd + 2 * kvd) + qd * c.hidden + 3 * c.hidden * c.intermediate
    head = 0 if c.tie_word_embeddings else c.hidden * c.vocab
    return dtype_bytes * (c.n_layers * per_layer + c.vocab * c.hidden + c.hidden + head)


def weight_bytes_per_step(config: LlamaConfig, batch: int, dtype_bytes: int = 2) -> int:
    """Weights one decode step must read: everything except the embedding (a B-row gather)."""
    emb = 0 if config.tie_word_embeddings else config.vocab * config.hidden * dtype_bytes
    return param_bytes(config, dtype_bytes) - emb + batch * config.hidden * dtype_bytes


def cache_bytes_per_step(config: LlamaConfig, s: Settings, cache: str, impl: str, batch: int,
                         context: int, t_max: int) -> int:
    """KV bytes one decode step reads (see the markdown's 'where the time goes')."""
    c = config
    fp = jnp.dtype(s.dtype).itemsize
    lbh = c.n_layers * batch * c.n_kv_heads
    if cache == "bf16":  # the dense cache attends over every preallocated slot (masked)
        return 2 * lbh * t_max * c.head_dim * fp
    code_bytes = 1 if s.nbits <= 8 else 2
    tokens = context if impl == "pallas" else t_max  # the kernel stops at the length; xla tiles all
    codebooks = 2 * c.n_layers * c.n_kv_heads * s.M * 2**s.nbits * (c.head_dim // s.M) * 4
    exact = 2 * lbh * (s.window + s.sinks) * c.head_dim * fp
    return 2 * lbh * tokens * s.M * code_bytes + codebooks + exact


@functools.partial(jax.jit, static_argnames=("chunk",))
def _rel_mse(cb: Any, x: jax.Array, chunk: int) -> jax.Array:
    """||decode(encode(x)) - x||^2 / ||x||^2 (encode in small chunks: G * M problems run at once)."""
    xhat = decode(cb, encode(cb, x, chunk_size=chunk))
    return jnp.mean((xhat - x) ** 2) / jnp.mean(x**2)


# ----------------------------------------------------------------------------- rows


def new_row(kind: str, device: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ROW_KEYS}
    row.update(kind=kind, device=device, **fields)
    return row


@dataclasses.dataclass
class ModelState:
    """A model's config, its live params (while loaded) and its codebooks once fitted."""

    name: str
    config: LlamaConfig
    seed: int
    params: Any = None
    codebooks: PQCodebooks | None = None
    info_row: dict[str, Any] | None = None


class Runner:
    """Runs the grid, keeps the rows, writes results after every row."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.budget = Budget(s.budget_s)
        self.info = device_info()
        self.device = self.info["device"]
        self.on_gpu = self.info["platform"] == "gpu"
        self.rows: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self.copy_bw = float("nan")
        self.pallas_broken: str | None = None
        self.compile_s: dict[str, float] = {}  # worst compile time seen per program kind
        self.prefill_rate: float | None = None  # seconds per (B * T * T_max * L * H)
        configs = model_configs(s.tiny)
        self.models = [ModelState(n, configs[n], seed=i) for i, n in enumerate(s.models)]
        self.loaded: ModelState | None = None

    # --- bookkeeping ------------------------------------------------------------
    def log(self, msg: str) -> None:
        print(f"[{self.budget.elapsed():6.1f}s] {msg}", flush=True)

    def write(self) -> str:
        return write_results(self.rows, self.meta, self.s.out, self.s.stamp)

    def device_limit(self) -> int | None:
        if self.s.assume_device_bytes is not None:
            return self.s.assume_device_bytes
        stats = _memory_stats()
        return None if stats is None else stats.get("bytes_limit")

    def bytes_in_use(self) -> int:
        stats = _memory_stats()
        if stats is None:  # CPU: count what we hold
            held = 0 if self.loaded is None else tree_bytes(self.loaded.params)
            return held
        return int(stats.get("bytes_in_use", 0))

    def note_compile(self, kind: str, seconds: float) -> None:
        self.compile_s[kind] = max(self.compile_s.get(kind, 0.0), seconds)

    def compile_estimate(self, kind: str) -> float:
        default = 5.0 if self.s.tiny else 30.0
        return self.compile_s.get(kind, max(self.compile_s.values(), default=default))

    # --- models -------------------------------------------------------------------
    def load(self, m: ModelState) -> None:
        """Make ``m`` the one model with weights on the device (random bf16, made there)."""
        if self.loaded is m:
            return
        if self.loaded is not None:
            self.loaded.params = None
            self.loaded = None
            gc.collect()
        t0 = time.perf_counter()
        m.params = jax.block_until_ready(init_params(m.config, jax.random.key(1000 + m.seed), jnp.dtype(self.s.dtype)))
        dt = time.perf_counter() - t0
        self.loaded = m
        if m.info_row is None:
            m.info_row = new_row("model", self.device, model=m.name, init_seconds=dt,
                                 param_bytes=tree_bytes(m.params),
                                 config=dataclasses.asdict(m.config))
            self.rows.append(m.info_row)
        self.log(f"{m.name}: weights {tree_bytes(m.params) / GiB:.2f} GiB in {dt:.1f}s")

    def calibrate(self, m: ModelState, dense: DenseCache | None = None) -> None:
        """Fit layer_head K/V codebooks on the model's own post-RoPE K/V (random-token prompt).

        With ``dense`` (a cache filled by a real prefill) its first ``calib_tokens`` positions
        are used (causal: the same K/V as a prefill of just those tokens); otherwise a
        ``calib_tokens`` prompt is prefilled into a fresh DenseCache.
        """
        s, cfg = self.s, m.config
        n = s.calib_tokens
        t0 = time.perf_counter()
        if dense is not None and int(jnp.min(dense.lengths)) >= n:
            src = "first tokens of a prefilled context"
            view = DenseCache(k=dense.k[:, :1, :, :n], v=dense.v[:, :1, :, :n],
                              lengths=jnp.full((1,), n, jnp.int32))
        else:
            src = "dedicated prefill"
            empty = DenseCache.create(cfg.n_layers, 1, cfg.n_kv_heads, n, cfg.head_dim, jnp.dtype(s.dtype))
            toks = jax.random.randint(jax.random.key(77 + m.seed), (1, n), 0, cfg.vocab, jnp.int32)
            _, view = prefill(cfg, m.params, empty, toks, jnp.full((1,), n, jnp.int32), last_only=True)
        k, v = collect_kv(view)
        del view
        t1 = time.perf_counter()
        books = fit_kv_codebooks(k, v, M=s.M, nbits=s.nbits, granularity="layer_head",
                                 key=jax.random.key(5 + m.seed), max_vectors=max(n, 2**s.nbits),
                                 iters=s.calib_iters, chunk_size=s.calib_chunk)
        books = jax.block_until_ready(books)
        t2 = time.perf_counter()
        # quality check on the calibration K/V themselves
        mse_k = float(_rel_mse(books.key, jnp.asarray(k), s.calib_chunk))
        mse_v = float(_rel_mse(books.value, jnp.asarray(v), s.calib_chunk))
        m.codebooks = books
        m.info_row.update(calib_source=src, calib_tokens=n, calib_iters=s.calib_iters,
                          calib_collect_seconds=t1 - t0, calib_kmeans_seconds=t2 - t1,
                          codebook_bytes=books.nbytes, calib_rel_mse_k=mse_k, calib_rel_mse_v=mse_v)
        self.log(f"{m.name}: codebooks ({src}) k-means {t2 - t1:.1f}s, collect {t1 - t0:.1f}s, "
                 f"rel. MSE K {mse_k:.3f} V {mse_v:.3f}")

    # --- k-means -----------------------------------------------------------------------
    def bench_kmeans(self) -> None:
        s = self.s
        row = new_row("kmeans", self.device, model="kmeans", n_vectors=s.kmeans_vectors,
                      dim=s.kmeans_dim, M=s.kmeans_M, nbits=s.kmeans_nbits, iters=s.kmeans_iters,
                      data="standard normal, generated on the device")
        self.rows.append(row)
        est = 2 * self.compile_estimate("kmeans") + 10
        if not self.budget.allows(est):
            row.update(status="skipped", error=f"time budget ({self.budget.left():.0f}s left, ~{est:.0f}s needed)")
            return
        try:
            x = jax.random.normal(jax.random.key(3), (s.kmeans_vectors, s.kmeans_dim), jnp.float32)
            fit = lambda key: fit_codebooks(x, s.kmeans_M, s.kmeans_nbits, key=key,  # noqa: E731
                                            iters=s.kmeans_iters).centroids
            t0 = time.perf_counter()
            c = jax.block_until_ready(fit(jax.random.key(0)))
            first = time.perf_counter() - t0
            self.note_compile("kmeans", first)
            t0 = time.perf_counter()
            c = jax.block_until_ready(fit(jax.random.key(1)))
            second = time.perf_counter() - t0
            from million_jax.pq import Codebooks, reconstruction_mse

            mse = float(reconstruction_mse(Codebooks(c), x))
            t0 = time.perf_counter()  # kmeans() checks its input for NaN on the host: part of the time
            bool(np.isfinite(np.asarray(x)).all())
            host_check = time.perf_counter() - t0
            row.update(status="ok", seconds=second, first_call_seconds=first,
                       seconds_per_iter=second / s.kmeans_iters, reconstruction_mse=mse,
                       host_finite_check_seconds=host_check)
            self.log(f"k-means {s.kmeans_vectors} x {s.kmeans_dim}, M={s.kmeans_M}, "
                     f"nbits={s.kmeans_nbits}, {s.kmeans_iters} it: {second:.2f}s "
                     f"(first call incl. compile {first:.2f}s), MSE {mse:.4f}")
        except Exception as e:  # noqa: BLE001
            row.update(status="oom" if is_oom(e) else "error", error=short_error(e))
            self.log(f"k-means FAILED {short_error(e)}")
        finally:
            x = c = None  # noqa: F841
            gc.collect()

    # --- decode rows ---------------------------------------------------------------
    def pair(self, m: ModelState, batch: int, context: int) -> None:
        """The bf16 row, then the PQ row, of one (model, batch, context); sets the speedup."""
        dense = self.cache_row(m, batch, context, "bf16")
        pq = self.cache_row(m, batch, context, "pq")
        if dense["status"] == "ok":
            dense["speedup"] = 1.0
        if dense["status"] == "ok" and pq["status"] == "ok":
            pq["speedup"] = dense["ms_per_token"] / pq["ms_per_token"]
        self.write()

    def uses_prefill(self, batch: int, context: int) -> bool:
        return batch in self.s.prefill_batches and context <= self.s.prefill_max_context

    def estimate_row(self, m: ModelState, batch: int, context: int, t_max: int, cache: str,
                     real: bool) -> float:
        """Seconds a row is expected to take (compiles + runs), for the time guard."""
        c, s = m.config, self.s
        est = self.compile_estimate(f"generate-{cache}")
        if real:
            est += self.compile_estimate(f"prefill-{cache}")
            work = batch * context * t_max * c.n_layers * c.n_heads
            rate = self.prefill_rate or (5e-12 if not s.tiny else 1e-9)
            est += work * rate * (2.0 if cache == "pq" else 1.0)
        else:
            est += 2.0
        bw = self.copy_bw if math.isfinite(self.copy_bw) else 1e12
        floor = (weight_bytes_per_step(c, batch, jnp.dtype(s.dtype).itemsize) + cache_bytes_per_step(c, s, cache, "xla", batch, context, t_max)) / bw
        est += (1 + s.repeats) * s.new_tokens * floor * 4 + 1.0
        if cache == "pq" and m.codebooks is None:
            est += 20.0
        return est

    def cache_row(self, m: ModelState, batch: int, context: int, cache: str) -> dict[str, Any]:
        s, c = self.s, m.config
        headroom = (1 + s.repeats) * s.new_tokens + 1
        t_max = context + (-(-headroom // 64) * 64)
        real = self.uses_prefill(batch, context)
        row = new_row("decode", self.device, model=m.name, context=context, batch=batch, cache=cache,
                      t_max=t_max, new_tokens=s.new_tokens, repeats=s.repeats,
                      fill="prefill" if real else "synthetic",
                      M=s.M if cache == "pq" else None, nbits=s.nbits if cache == "pq" else None,
                      window=s.window if cache == "pq" else None, sinks=s.sinks if cache == "pq" else None,
                      weight_bytes_per_step=weight_bytes_per_step(c, batch, jnp.dtype(s.dtype).itemsize))
        self.rows.append(row)
        est = self.estimate_row(m, batch, context, t_max, cache, real)
        if not self.budget.allows(est):
            row.update(status="skipped", error=f"time budget ({self.budget.left():.0f}s left, ~{est:.0f}s needed)")
            self.log(f"{m.name} B={batch} T={context} {cache}: skipped (time budget)")
            return row
        limit = self.device_limit()
        if limit is not None:  # cheap check before compiling anything: weights + cache alone
            other = self.bytes_in_use() - (0 if self.loaded is None else tree_bytes(self.loaded.params))
            cache_b = tree_bytes(jax.eval_shape(self.empty_cache_fn(m, batch, t_max, cache, "xla")))
            need = other + param_bytes(c, jnp.dtype(s.dtype).itemsize) + cache_b
            if need > 0.98 * limit:
                row.update(status="oom", cache_bytes=cache_b, predicted_bytes=need,
                           error=f"predicted: weights + cache need {need / GiB:.1f} GiB of {limit / GiB:.1f} GiB")
                self.log(f"{m.name} B={batch} T={context} {cache}: oom ({row['error']})")
                return row
        try:
            self.load(m)
            if cache == "pq" and m.codebooks is None:
                self.calibrate(m)
        except Exception as e:  # noqa: BLE001
            row.update(status="oom" if is_oom(e) else "error", error=f"setup: {short_error(e)}")
            self.log(f"{m.name}: setup FAILED {short_error(e)}")
            return row
        impl = "xla" if cache == "bf16" else self.pq_impl(m, batch, t_max)
        note = None
        if cache == "pq" and self.pallas_broken and impl == "pallas":
            impl, note = "xla", f"pallas failed earlier: {self.pallas_broken}"
        result = self.run_row(m, batch, context, t_max, cache, impl, real, row)
        if cache == "pq" and impl == "pallas" and result == "pallas-failed":
            note = f"pallas failed: {row.get('error')}"
            self.pallas_broken = row.get("error")
            row.update(status=None, error=None)
            gc.collect()
            impl = "xla"
            result = self.run_row(m, batch, context, t_max, cache, impl, real, row)
        row.update(impl=impl, impl_note=note)
        if row["status"] == "ok":
            self.log(f"{m.name} B={batch} T={context} {cache}[{impl}] {row['fill']}: "
                     f"{row['ms_per_token']:.2f} ms/token, peak {(row['peak_bytes'] or 0) / GiB:.1f} GiB, "
                     f"compile {row['compile_seconds']:.1f}s"
                     + ("" if row["prefill_seconds"] is None else
                        f", prefill {row['prefill_seconds']:.2f}s (compile {row['prefill_compile_seconds']:.1f}s)"))
        else:
            self.log(f"{m.name} B={batch} T={context} {cache}[{impl}]: {row['status']} {row.get('error') or ''}")
        gc.collect()
        return row

    def pq_impl(self, m: ModelState, batch: int, t_max: int) -> str:
        """'pallas' or 'xla': what impl='auto' picks on this backend (or the forced choice)."""
        if self.s.pq_impl != "auto":
            return self.s.pq_impl
        if not self.on_gpu and not self.s.fail_pallas:
            return "xla"
        from pallas_kernels import pq_kernel_unsupported_reason

        c, s = m.config, self.s
        sd = jax.ShapeDtypeStruct
        dsub = c.head_dim // s.M
        code = jnp.uint8 if s.nbits <= 8 else jnp.uint16
        reason = pq_kernel_unsupported_reason(
            sd((batch, c.n_heads, c.head_dim), jnp.dtype(s.dtype)),
            sd((batch, c.n_kv_heads, t_max, s.M), code), sd((batch, c.n_kv_heads, t_max, s.M), code),
            sd((c.n_kv_heads, s.M, 2**s.nbits, dsub), jnp.float32),
            sd((c.n_kv_heads, s.M, 2**s.nbits, dsub), jnp.float32),
            sd((batch,), jnp.int32), sd((batch,), jnp.int32))
        return "pallas" if reason is None else "xla"

    def empty_cache_fn(self, m: ModelState, batch: int, t_max: int, cache: str, impl: str) -> Callable[[], Any]:
        """A function making the row's empty cache (PQ: shaped by the codebooks when fitted)."""
        c, s = m.config, self.s
        dt = jnp.dtype(s.dtype)
        if cache == "bf16":
            return lambda: DenseCache.create(c.n_layers, batch, c.n_kv_heads, t_max, c.head_dim, dt)
        if m.codebooks is None:
            return lambda: PQCache.create(c.n_layers, batch, c.n_kv_heads, t_max, c.head_dim, M=s.M,
                                          nbits=s.nbits, window=s.window, sinks=s.sinks, dtype=dt, impl=impl)
        return lambda: PQCache.for_codebooks(m.codebooks, c.n_layers, batch, c.n_kv_heads, t_max,
                                             window=s.window, sinks=s.sinks, dtype=dt, impl=impl)

    def run_row(self, m: ModelState, batch: int, context: int, t_max: int, cache: str, impl: str,
                real: bool, row: dict[str, Any]) -> str:
        """Compile, check memory, fill, time. Returns 'ok', 'failed' or 'pallas-failed'."""
        s, c = self.s, m.config
        consts = m.codebooks if cache == "pq" else None
        make_empty = self.empty_cache_fn(m, batch, t_max, cache, impl)
        cache_struct = jax.eval_shape(make_empty)
        tok_struct = jax.ShapeDtypeStruct((batch,), jnp.int32)
        stage = "compile"
        filled = out = None
        try:
            if s.fail_pallas and impl == "pallas":
                raise RuntimeError("simulated Pallas failure (--fail-pallas)")
            # 1. compile the fill and decode programs (no device memory for the cache yet)
            if real:
                keys = t_max if cache == "bf16" else PQ_PREFILL_TILE
                chunk = prefill_chunk(batch, context, keys, c.n_heads, s.prefill_score_bytes)
                fill = compile_program(make_prefill_fn(c, chunk), m.params, cache_struct,
                                       jax.ShapeDtypeStruct((batch, context), jnp.int32), consts)
                self.note_compile(f"prefill-{cache}", fill.compile_seconds)
                row.update(prefill_chunk=chunk, prefill_compile_seconds=fill.compile_seconds,
                           prefill_peak_bytes=fill.peak_bytes)
            else:
                fill = compile_program(make_synthetic_fn(make_empty, context, s.nbits))
            gen = compile_program(make_generate_fn(c, s.new_tokens), m.params, cache_struct, tok_struct, consts)
            self.note_compile(f"generate-{cache}", gen.compile_seconds)
            row.update(compile_seconds=gen.compile_seconds, peak_bytes=gen.peak_bytes,
                       peak_source="compiled memory analysis (arguments + outputs + temporaries - aliases)",
                       memory_analysis=gen.memory, cache_bytes=tree_bytes(cache_struct),
                       codebook_bytes=None if consts is None else consts.nbytes,
                       cache_read_bytes_per_step=cache_bytes_per_step(c, s, cache, impl, batch, context, t_max),
                       hlo_layer_state_ops=layer_state_ops(gen.hlo_text, cache_struct))
            # 2. memory check: the cache and scratch must fit next to what is already resident
            limit = self.device_limit()
            resident = tree_bytes(m.params) + (0 if consts is None else tree_bytes(consts))
            need = max(p.peak_bytes or 0 for p in (fill, gen)) - resident
            if not real:
                need = max(need, tree_bytes(cache_struct))
            row["predicted_bytes"] = self.bytes_in_use() + need
            if limit is not None and row["predicted_bytes"] > 0.98 * limit:
                row.update(status="oom", error=(f"predicted: needs {row['predicted_bytes'] / GiB:.1f} GiB "
                                                f"of {limit / GiB:.1f} GiB (compiled memory analysis)"))
                return "failed"
            # 3. fill the cache
            stage = "fill"
            if real:
                empty = jax.jit(make_empty)()
                toks = jax.random.randint(jax.random.key(11), (batch, context), 0, c.vocab, jnp.int32)
                jax.block_until_ready((empty, toks))
                t0 = time.perf_counter()
                logits, filled = fill(m.params, empty, toks, consts)
                jax.block_until_ready((logits, filled))
                dt = time.perf_counter() - t0
                del empty
                row.update(prefill_seconds=dt, prefill_tokens_per_s=batch * context / dt,
                           prefill_logits_finite=bool(jnp.isfinite(logits).all()))
                work = batch * context * t_max * c.n_layers * c.n_heads
                rate = dt / work / (2.0 if cache == "pq" else 1.0)
                self.prefill_rate = max(self.prefill_rate or 0.0, rate)
            else:
                t0 = time.perf_counter()
                filled = jax.block_until_ready(fill())
                row["fill_seconds"] = time.perf_counter() - t0
            stats = _memory_stats()
            row["bytes_in_use_after_fill"] = None if stats is None else stats.get("bytes_in_use")
            if cache == "bf16" and real and m.codebooks is None:
                self.calibrate(m, filled)  # reuse this prefill's K/V for the PQ rows
            # 4. decode: warm-up, then timed calls; each continues the cache (N tokens per call)
            stage = "decode"
            token = jax.random.randint(jax.random.key(12), (batch,), 0, c.vocab, jnp.int32)
            times, counts = [], []
            for r in range(1 + s.repeats):
                t0 = time.perf_counter()
                out = gen(m.params, filled, token, consts)
                filled = None
                jax.block_until_ready(out)
                dt = time.perf_counter() - t0
                _, n_gen, filled = out
                out = None
                counts.append(int(jnp.min(n_gen)))
                if r:
                    times.append(dt)
            ms = [1e3 * t / s.new_tokens for t in times]
            stats = _memory_stats()
            row.update(status="ok", ms_per_token=float(np.median(ms)), ms_per_token_min=min(ms),
                       times_ms_per_token=ms, tokens_per_s=1e3 * batch / float(np.median(ms)),
                       final_length=int(jnp.max(filled.lengths)),
                       process_peak_bytes_in_use=None if stats is None else stats.get("peak_bytes_in_use"))
            if min(counts) != s.new_tokens:
                row.update(status="error", error=f"a generate call stopped early: {counts} tokens")
            return "ok" if row["status"] == "ok" else "failed"
        except Exception as e:  # noqa: BLE001 - record the row, carry on with the next
            oom = is_oom(e)
            row.update(status="oom" if oom else "error", error=f"{stage}: {short_error(e)}")
            if not oom and not s.tiny:
                traceback.print_exc(limit=3)
            if cache == "pq" and impl == "pallas" and not oom:
                return "pallas-failed"
            return "failed"
        finally:
            filled = out = None  # noqa: F841
            gc.collect()

    # --- the whole run -----------------------------------------------------------------
    def plan(self) -> list[tuple[str, Any]]:
        """Work items in priority order: headline pairs first, then k-means, then the rest.

        Pairs (batch, context) run for every model before the next pair, so a run cut short by
        the time guard still has both models at the most important shapes.
        """
        s = self.s
        bmin = min(s.batches)
        short = [c for c in s.contexts if c <= 32768]
        head = max(short) if short else min(s.contexts)  # MILLION's headline is 32K
        stage1 = [(bmin, head)] + ([(bmin, min(s.contexts))] if min(s.contexts) != head else [])
        rest = sorted(((b, t) for b in s.batches for t in s.contexts if (b, t) not in stage1),
                      key=lambda bt: (bt[0] * bt[1], bt[0]))
        items: list[tuple[str, Any]] = [("pair", bt) for bt in stage1]
        if not s.skip_kmeans:
            items.append(("kmeans", None))
        items += [("pair", bt) for bt in rest]
        return items

    def print_plan(self) -> int:
        """The work items in order, with the fill kind and weight / cache sizes (nothing runs)."""
        s = self.s
        limit = self.device_limit()
        fp = jnp.dtype(s.dtype).itemsize
        print(f"budget {s.budget_s:.0f}s, device limit "
              f"{'unknown' if limit is None else f'{limit / GiB:.1f} GiB'}; N={s.new_tokens}, "
              f"repeats={s.repeats}", flush=True)
        for what, arg in self.plan():
            if what == "kmeans":
                print(f"k-means {s.kmeans_vectors} x {s.kmeans_dim}, M={s.kmeans_M}, nbits={s.kmeans_nbits}, "
                      f"{s.kmeans_iters} iterations", flush=True)
                continue
            batch, context = arg
            for m in self.models:
                headroom = (1 + s.repeats) * s.new_tokens + 1
                t_max = context + (-(-headroom // 64) * 64)
                w = param_bytes(m.config, fp)
                sizes = []
                for cache in ("bf16", "pq"):
                    cb = tree_bytes(jax.eval_shape(self.empty_cache_fn(m, batch, t_max, cache, "xla")))
                    fits = "" if limit is None or w + cb <= 0.98 * limit else " (OOM)"
                    sizes.append(f"{cache} {cb / GiB:6.1f} GiB{fits}")
                print(f"{m.name:12s} B={batch} T={context:6d} {'prefill' if self.uses_prefill(batch, context) else 'synthetic':9s} "
                      f"weights {w / GiB:5.1f} GiB, " + ", ".join(sizes), flush=True)
        return 0

    def run(self) -> int:
        s = self.s
        self.copy_bw = copy_bandwidth(s.tiny)
        self.meta = dict(self.info, copy_gbps=self.copy_bw / 1e9, date=s.stamp, M=s.M, nbits=s.nbits,
                         window=s.window, sinks=s.sinks, granularity="layer_head", dtype=s.dtype,
                         new_tokens=s.new_tokens, repeats=s.repeats, pq_impl_requested=s.pq_impl,
                         budget_s=s.budget_s, tiny=s.tiny, models=list(s.models),
                         contexts=list(s.contexts), batches=list(s.batches),
                         prefill_batches=list(s.prefill_batches), prefill_max_context=s.prefill_max_context,
                         calib_tokens=s.calib_tokens, calib_iters=s.calib_iters,
                         timing=("decode: models.generate in one jit (cache donated) continuing the filled "
                                 "cache with a 1-token prompt for N tokens = N forward passes; wall time / N, "
                                 "median of the timed calls after one warm-up; compile excluded"),
                         peak_source="compiled memory analysis of the decode program (arguments + outputs "
                                     "+ temporaries - donated aliases); allocator peak not resettable")
        self.rows.append(new_row("env", self.device, copy_gbps=self.copy_bw / 1e9,
                                 **{k: v for k, v in self.info.items() if k != "device"}))
        self.log(f"device {self.device} ({self.info['platform']}), jax {jax.__version__}, copy bandwidth "
                 f"{self.copy_bw / 1e9:.0f} GB/s, memory limit "
                 f"{'unknown' if self.device_limit() is None else f'{self.device_limit() / GiB:.1f} GiB'}, "
                 f"budget {s.budget_s:.0f}s")
        self.write()
        for what, arg in self.plan():
            if what == "kmeans":
                self.bench_kmeans()
                self.write()
                continue
            batch, context = arg
            for m in self.models:
                self.pair(m, batch, context)
        self.meta["elapsed_s"] = self.budget.elapsed()
        base = self.write()
        print_summary(self.rows)
        self.log(f"wrote {base}.json and {base}.md")
        return 0


def layer_state_ops(hlo_text: Callable[[], str], cache_struct: Any) -> dict[str, int] | None:
    """Count optimized-HLO instructions that produce a whole per-layer cache array, by opcode.

    A hint for 'where the time goes': each such op per decoded layer moves a full layer of
    cache (e.g. a copy of the layer slice for an in-place update or a custom call operand).
    """
    try:
        text = hlo_text()
    except Exception:  # noqa: BLE001
        return None
    shapes = set()
    for leaf in jax.tree.leaves(cache_struct):
        if len(leaf.shape) == 5 and int(np.prod(leaf.shape)) > 0:
            dt = {"bfloat16": "bf16", "uint8": "u8", "uint16": "u16", "float32": "f32"}.get(
                jnp.dtype(leaf.dtype).name, jnp.dtype(leaf.dtype).name)
            shapes.add(f"{dt}[{','.join(str(d) for d in leaf.shape[1:])}]")
    counts: dict[str, int] = {}
    pat = re.compile(r"=\s*(\S+?)(?:\{[^}]*\})?\s+([a-z][\w-]*)\(")
    for line in text.splitlines():
        mm = pat.search(line)
        if mm and mm.group(1) in shapes:
            counts[mm.group(2)] = counts.get(mm.group(2), 0) + 1
    return counts


# ----------------------------------------------------------------------------- output


def _fmt(x: float | None, spec: str, none: str = "") -> str:
    return none if x is None else format(x, spec)


def _gib(x: int | None) -> str:
    return "" if x is None else f"{x / GiB:.1f}"


def time_analysis(rows: list[dict[str, Any]], copy_gbps: float) -> list[str]:
    """The 'where the time goes' markdown section, computed from the measured rows."""
    ok = [r for r in rows if r["kind"] == "decode" and r["status"] == "ok"]
    if not ok or not math.isfinite(copy_gbps) or copy_gbps <= 0:
        return []
    bw = copy_gbps * 1e9
    lines = ["## Where the time goes", "",
             f"Per decode step the model must at least read its weights once (all layer matrices and "
             f"the LM head; the embedding is a B-row gather) and its KV cache: bf16 reads every "
             f"preallocated slot (2 L B Hkv T_max d 2 bytes), PQ the K + V codes of the stored tokens "
             f"(the xla path tiles over all T_max slots) plus the fp32 codebooks. floor = bytes / "
             f"{copy_gbps:.0f} GB/s (the measured device copy bandwidth, read + write).", "",
             "| model | batch | context | cache | impl | weights GB | cache GB | floor ms | measured ms "
             "| measured / floor | beyond floor ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        w, kv = r["weight_bytes_per_step"], r["cache_read_bytes_per_step"]
        floor = 1e3 * (w + kv) / bw
        r["floor_ms"] = floor
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['cache']} | {r['impl']} | "
                     f"{w / 1e9:.2f} | {kv / 1e9:.2f} | {floor:.2f} | {r['ms_per_token']:.2f} | "
                     f"{r['ms_per_token'] / floor:.2f} | {r['ms_per_token'] - floor:.2f} |")
    fits = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault((r["model"], r["batch"], r["cache"], r["impl"]), []).append(r)
    for (model, batch, cache, impl), rs in groups.items():
        xs = np.array([r["cache_read_bytes_per_step"] for r in rs], float)
        ys = np.array([r["ms_per_token"] for r in rs], float)
        if len(rs) < 2 or np.ptp(xs) <= 0:
            continue
        slope, icpt = np.polyfit(xs, ys, 1)
        wfloor = 1e3 * rs[0]["weight_bytes_per_step"] / bw
        eff = 1e-6 / slope if slope > 0 else float("inf")  # slope: ms per byte -> GB/s
        fits.append(f"| {model} | {batch} | {cache} | {impl} | {icpt:.2f} | {wfloor:.2f} | "
                    f"{eff:.0f} | {100 * eff / copy_gbps:.0f} | {len(rs)} |")
    if fits:
        lines += ["", "Linear fit over contexts, ms/token = fixed + cache bytes / effective bandwidth "
                  "(fixed: per-step cost that does not grow with the context, to compare with the "
                  "weight-read floor):", "",
                  "| model | batch | cache | impl | fixed ms | weight floor ms | effective cache GB/s "
                  "| % of copy BW | points |", "|---|---|---|---|---|---|---|---|---|"]
        lines += fits
    notes = []
    by_key = {(r["model"], r["batch"], r["context"], r["cache"]): r for r in ok}
    for (model, batch, context, cache), r in sorted(by_key.items()):
        if cache != "pq" or (model, batch, context, "bf16") not in by_key:
            continue
        d = by_key[(model, batch, context, "bf16")]
        ideal = d["floor_ms"] / r["floor_ms"]
        notes.append(
            f"- {model}, batch {batch}, {context} tokens: bf16 {d['ms_per_token']:.2f} ms "
            f"(floor {d['floor_ms']:.2f}: weights {1e3 * d['weight_bytes_per_step'] / bw:.2f} + cache "
            f"{1e3 * d['cache_read_bytes_per_step'] / bw:.2f}), PQ[{r['impl']}] {r['ms_per_token']:.2f} ms "
            f"(floor {r['floor_ms']:.2f}); the byte floors allow {ideal:.2f}x, measured "
            f"{d['ms_per_token'] / r['ms_per_token']:.2f}x; beyond its floor PQ spends "
            f"{r['ms_per_token'] - r['floor_ms']:.2f} ms (LUT / gather / encode / merge and "
            f"layout copies) against bf16's {d['ms_per_token'] - d['floor_ms']:.2f} ms.")
    only_pq = [r for r in rows if r["kind"] == "decode" and r["cache"] == "pq" and r["status"] == "ok"
               and any(d["kind"] == "decode" and d["cache"] == "bf16" and d["status"] == "oom"
                       and (d["model"], d["batch"], d["context"]) == (r["model"], r["batch"], r["context"])
                       for d in rows)]
    for r in only_pq:
        notes.append(f"- {r['model']}, batch {r['batch']}, {r['context']} tokens: the bf16 cache does not fit; "
                     f"PQ runs at {r['ms_per_token']:.2f} ms/token in {_gib(r['peak_bytes'])} GiB.")
    if notes:
        lines += ["", *notes]
    return lines + [""]


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: str, stamp: str) -> str:
    """Write <out>/gpu_e2e_<stamp>.json (the rows) and .md; return the path without suffix."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"gpu_e2e_{stamp}")
    copy_gbps = float(meta.get("copy_gbps", float("nan")))
    analysis = time_analysis(rows, copy_gbps)  # also sets each measured row's floor_ms
    with open(base + ".json", "w") as f:
        json.dump(rows, f, indent=1, default=str)
    lines = [f"# End-to-end decode: PQ KV cache vs bf16 KV cache ({meta.get('device', '?')})", "",
             f"jax {meta.get('jax')}, {meta.get('date')}, copy bandwidth {copy_gbps:.0f} GB/s (read + write), "
             f"PQ M={meta.get('M')}, nbits={meta.get('nbits')}, {meta.get('granularity')} codebooks from "
             f"{meta.get('calib_tokens')} calibration tokens ({meta.get('calib_iters')} k-means iterations), "
             f"window {meta.get('window')}, sinks {meta.get('sinks')}; random {meta.get('dtype')} weights "
             f"and dense cache (rows labelled 'bf16').", "",
             f"Timing: {meta.get('timing')}. Peak memory: {meta.get('peak_source')}. "
             f"Fill \"prefill\" = the context's random tokens run through the model (chunked, timed once; "
             f"PQ includes encoding); \"synthetic\" = the cache created holding the context "
             f"(pseudo-random K/V or codes), no prefill time.", ""]
    if meta.get("elapsed_s") is not None:
        lines += [f"Run took {meta['elapsed_s']:.0f}s (budget {meta.get('budget_s'):.0f}s).", ""]
    lines += ["| model | batch | context | cache | impl | fill | ms / token | speedup | peak GiB | "
              "prefill s | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "decode":
            continue
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        status = r["status"] or ""
        if status != "ok" and r.get("error"):
            status += f": {r['error'][:90]}"
        if r.get("impl_note"):
            status += f" ({r['impl_note'][:60]})"
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['cache']} | {r['impl'] or ''} | "
                     f"{r.get('fill') or ''} | {_fmt(r['ms_per_token'], '.2f')} | {sp} | "
                     f"{_gib(r['peak_bytes'])} | {_fmt(r['prefill_seconds'], '.2f')} | {status} |")
    lines.append("")
    for r in rows:
        if r["kind"] == "model" and r.get("calib_kmeans_seconds") is not None:
            lines.append(f"- {r['model']}: weights {_gib(r['param_bytes'])} GiB (init {r['init_seconds']:.1f}s); "
                         f"codebooks {r['codebook_bytes'] / 2**20:.0f} MiB from {r['calib_source']}, k-means "
                         f"{r['calib_kmeans_seconds']:.1f}s, relative MSE K {r['calib_rel_mse_k']:.3f} / "
                         f"V {r['calib_rel_mse_v']:.3f}.")
        if r["kind"] == "kmeans":
            if r["status"] == "ok":
                lines.append(f"- k-means (million_jax.pq.fit_codebooks): {r['n_vectors']} vectors, d={r['dim']}, "
                             f"M={r['M']}, nbits={r['nbits']}, {r['iters']} iterations: {r['seconds']:.2f}s "
                             f"({1e3 * r['seconds_per_iter']:.0f} ms / iteration; first call incl. compile "
                             f"{r['first_call_seconds']:.2f}s), reconstruction MSE {r['reconstruction_mse']:.4f}.")
            else:
                lines.append(f"- k-means: {r['status']} {r.get('error') or ''}")
    lines.append("")
    lines += analysis
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return base


def print_summary(rows: list[dict[str, Any]]) -> None:
    """A short table on stdout (the device tool returns only the tail of the output)."""
    print("model        B  context cache impl   fill      ms/tok  speedup  peakGiB  prefill_s status", flush=True)
    for r in rows:
        if r["kind"] != "decode":
            continue
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"{r['model']:12s} {r['batch']:<2d} {r['context']:7d} {r['cache']:5s} {str(r['impl'] or ''):6s} "
              f"{str(r.get('fill') or ''):9s} {_fmt(r['ms_per_token'], '7.2f', '      -')} {sp:>8s} "
              f"{_gib(r['peak_bytes']):>8s} {_fmt(r['prefill_seconds'], '9.2f', '        -')} "
              f"{r['status']}{'' if r['status'] == 'ok' else ' ' + str(r.get('error') or '')[:60]}", flush=True)
    for r in rows:
        if r["kind"] == "kmeans":
            print(f"k-means: {r['status']} {_fmt(r.get('seconds'), '.2f')}s "
                  f"(first call {_fmt(r.get('first_call_seconds'), '.2f')}s) {r.get('error') or ''}", flush=True)


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    if not s.tiny and jax.devices()[0].platform != "gpu":
        print(f"warning: no GPU ({jax.devices()[0].device_kind}); timings are not meaningful "
              "(use --tiny on CPU)", flush=True)
    runner = Runner(s)
    return runner.print_plan() if s.plan_only else runner.run()


if __name__ == "__main__":
    sys.exit(main())
