"""Decoder models for million-jax (LLaMA, Gemma 3): config, functional model, loading, generation.

Pure functions take ``(config, params, ...)`` explicitly; ``prefill`` / ``decode_step`` are
jitted with the cache donated, and ``check_room`` is the host's overflow check before them::

    from models import load_model, prefill, decode_step, generate
    model = load_model("smollm2")
    cache = model.new_cache(batch=1, max_len=256)
    ids = model.encode("The quick brown fox")
    res = generate(model.config, model.params, cache, [ids], [len(ids)], max_new_tokens=20)
"""
from models.config import PRESETS, DecoderConfig, LlamaConfig, RopeScaling, preset
from models.errors import CheckpointError, ConfigError, ModelNotInstalledError
from models.generate import (STOP_CACHE_FULL, STOP_EOS, STOP_MAX_TOKENS, GenerateResult,
                             check_sampling, generate, prefill_prompt, sample_logits)
from models.decoder import (ContextLengthError, Params, cast_params, check_context, check_room, decode_step,
                            fill_cache, forward, init_cache, init_params, layer_inv_freqs, param_shapes, prefill,
                            rope_inv_freq)
from models.families import FAMILIES, Family
from models.loading import LoadedModel, load_model, smollm2_gguf_path

__all__ = [
    "DecoderConfig", "LlamaConfig", "RopeScaling", "Family", "FAMILIES", "PRESETS", "preset",
    "CheckpointError", "ConfigError", "ModelNotInstalledError",
    "Params", "param_shapes", "init_params", "cast_params", "init_cache",
    "forward", "prefill", "fill_cache", "decode_step", "check_room", "check_context", "ContextLengthError",
    "rope_inv_freq", "layer_inv_freqs",
    "generate", "prefill_prompt", "GenerateResult", "check_sampling", "sample_logits", "STOP_EOS", "STOP_MAX_TOKENS",
    "STOP_CACHE_FULL",
    "LoadedModel", "load_model", "smollm2_gguf_path",
]
