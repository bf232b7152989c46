"""Reference for teacher-forced scoring: log p of a continuation from one full forward, no cache."""
from __future__ import annotations

import jax
import numpy as np

from models import forward


def continuation_logp(config, params, prompt: list[int], cont: list[int]) -> np.ndarray:
    """float32[len(cont)]: log p(cont[i] | prompt, cont[:i]) from ``forward`` over prompt + cont."""
    seq = np.asarray([list(prompt) + list(cont)], np.int32)
    lp = jax.nn.log_softmax(np.asarray(forward(config, params, seq), np.float32)[0], axis=-1)
    return np.asarray([lp[len(prompt) - 1 + i, t] for i, t in enumerate(cont)], np.float32)
