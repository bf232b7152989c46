"""Opening a model and tokenizing text for the command line, with user-facing errors."""
from __future__ import annotations

import os
from typing import Sequence

from million_app.errors import UsageError
from models import CheckpointError, ConfigError, LoadedModel, ModelNotInstalledError, load_model


def open_model(spec: str) -> LoadedModel:
    """``load_model(spec)`` with every user mistake turned into a one-line UsageError.

    spec: ``smollm2``, ``gemma3-270m``, a ``.gguf`` file or an HF checkpoint directory. The model must
    come with a tokenizer (the command line works on text).
    """
    try:
        model = load_model(spec)
    except ModelNotInstalledError as e:
        raise UsageError(str(e)) from None
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"cannot load model {spec!r}: {e}") from None
    if model.tokenizer is None:
        raise UsageError(f"model {spec!r} has no tokenizer (tokenizer.json or GGUF tokenizer metadata)")
    return model


def model_name(model: LoadedModel) -> str:
    """A short display name: the checkpoint's file or directory name."""
    return os.path.basename(os.path.normpath(model.source)) or str(model.source)


def tokenize(model: LoadedModel, text: str, *, bos: bool = False) -> list[int]:
    """Token ids of the whole text, no special tokens added; ``bos`` prepends the BOS id once."""
    ids = list(model.tokenizer.encode(text, add_special_tokens=False).ids)
    if bos:
        if model.config.bos_id is None:
            raise UsageError("--bos: this model defines no BOS token")
        ids = [int(model.config.bos_id)] + ids
    return ids


def prompt_tokens(model: LoadedModel, text: str) -> list[int]:
    """Token ids of a prompt as the model expects it: BOS first where its tokenizer adds one
    (Gemma 3; a Gemma prompt without BOS derails), none otherwise (SmolLM2)."""
    return tokenize(model, text, bos=model.adds_bos)


def check_tokens(ids: Sequence[int], need: int, what: str) -> None:
    """UsageError unless ``ids`` holds at least ``need`` tokens."""
    if len(ids) < need:
        raise UsageError(f"{what} has {len(ids)} tokens, fewer than the {need} needed")
