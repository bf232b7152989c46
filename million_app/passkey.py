"""``million-jax passkey``: synthetic passkey retrieval, dense vs a quantized cache.

A prompt of about L tokens: an instruction, filler sentences repeated, the needle
"The pass key is 12345. Remember it. 12345 is the pass key." at a depth that varies
over the trials, more filler, and the question "What is the pass key? The pass key
is". Greedy decoding; a trial succeeds when the first number generated equals the key.
Prompts are built from separately tokenized pieces, so every prompt has at most L
tokens (the exact count is reported).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from million_app import progress
from million_app import caches
from million_app.errors import UsageError
from million_app.loading import prompt_tokens, tokenize
from million_jax.cache.spec import CacheSpec
from models import LoadedModel, generate

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 12


def passkey_prompt(model: LoadedModel, length: int, key: int, depth: float) -> list[int]:
    """Token ids of one prompt of at most ``length`` tokens, the needle at ``depth`` in [0, 1]."""
    intro, filler = prompt_tokens(model, INTRO), tokenize(model, FILLER)
    needle, question = tokenize(model, NEEDLE.format(key=key)), tokenize(model, QUESTION)
    budget = length - len(intro) - len(needle) - len(question)
    reps = budget // len(filler)
    if reps < 1:
        raise UsageError(f"--lengths {length} is too short for a passkey prompt "
                         f"(needs > {length - budget + len(filler)} tokens)")
    before = int(round(depth * reps))
    return intro + filler * before + needle + filler * (reps - before) + question


def first_number(text: str) -> int | None:
    """The first run of digits in ``text`` (None if there is none)."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def key_tokens(model: LoadedModel, key: int) -> list[int]:
    """The right answer's tokens as they follow the question: " 12345"."""
    return tokenize(model, f" {key}")


def run_trials(model: LoadedModel, prompts: Sequence[list[int]], keys: Sequence[int],
               spec: CacheSpec | None, batch: int, prefill_chunk: int | None = None, *,
               score: bool = True,
               make_cache: Callable[[int, int], tuple[Any, Any]] | None = None) -> list[dict[str, Any]]:
    """Greedy answers to every prompt through ``spec``, ``batch`` prompts per generate call, each
    prompt prefilled in forwards of ``prefill_chunk`` tokens (None: one forward).

    With ``score`` (default) each row also says how sure the model is of the right answer, from
    the same prefill (``generate(forced=...)``, which holds a second copy of the cache at its
    peak): ``key_logp`` = log p(" 12345" | prompt) with the key's tokens teacher forced,
    ``key_token_logp`` per token, and ``first_p`` = p of its first token. A right greedy answer
    with a first_p near 1/2 or below is a near-tie that a small perturbation can flip.
    """
    cfg = model.config
    answers = [key_tokens(model, k) for k in keys]
    # one width for the whole run (one compiled shape), ragged keys padded at the end
    forced_width = max(len(a) for a in answers)
    out = []
    for i in range(0, len(prompts), batch):
        group = list(prompts[i: i + batch])
        group_answers = list(answers[i: i + batch])
        real = len(group)
        group += [group[-1]] * (batch - real)  # one compiled shape per length
        group_answers += [group_answers[-1]] * (batch - real)
        width = max(len(p) for p in group)
        toks = np.zeros((batch, width), np.int32)
        forced = np.zeros((batch, forced_width), np.int32)
        for j, (p, a) in enumerate(zip(group, group_answers)):
            toks[j, : len(p)] = p
            forced[j, : len(a)] = a
        max_len = width + max(ANSWER_TOKENS, forced_width)
        cache, consts = make_cache(batch, max_len) if make_cache else caches.build(spec, cfg, batch, max_len)
        res = generate(cfg, model.params, cache, jnp.asarray(toks),
                       jnp.asarray([len(p) for p in group], jnp.int32),
                       max_new_tokens=ANSWER_TOKENS, cache_consts=consts, prefill_chunk=prefill_chunk,
                       forced=forced if score else None)
        logp = np.asarray(res.forced_logp) if score else None
        for j, seq in enumerate(res.sequences()[:real]):
            text = model.decode(seq, skip_special_tokens=True)
            key = keys[i + j]
            row = {"key": key, "answer": text, "correct": first_number(text) == key,
                   "prompt_tokens": len(prompts[i + j])}
            if score:
                lp = logp[j, : len(group_answers[j])]
                row.update(key_logp=round(float(lp.sum()), 4), key_token_logp=[round(float(x), 4) for x in lp],
                           first_p=float(f"{np.exp(lp[0]):.4g}"))
            out.append(row)
    return out


def mean_key_logp(rows: Sequence[dict[str, Any]]) -> float:
    """Mean ``key_logp`` of trial rows (rounded to 4 decimals), the score of a cell or length."""
    return round(float(np.mean([r["key_logp"] for r in rows])), 4)


def passkey_eval(model: LoadedModel, specs: Sequence[CacheSpec], lengths: Sequence[int], *,
                 trials: int = 5, seed: int = 0, batch: int = 5,
                 prefill_chunk: int | None = None) -> dict[str, Any]:
    """Accuracy and mean log p(key) per length for each cache spec:
    {"lengths": [...], "results": {label: [{"length", "accuracy", "key_logp", "trials"}, ...]}}."""
    rng = np.random.default_rng(seed)
    results: dict[str, list[dict[str, Any]]] = {caches.label(s): [] for s in specs}
    for length in lengths:
        keys = [int(k) for k in rng.integers(10000, 100000, size=trials)]
        depths = [(i + 0.5) / trials for i in range(trials)]
        prompts = [passkey_prompt(model, length, k, d) for k, d in zip(keys, depths)]
        for spec in specs:
            progress.status(f"passkey length {length}: {caches.label(spec)} ({trials} prompt{'' if trials == 1 else 's'})")
            rows = run_trials(model, prompts, keys, spec, min(batch, trials), prefill_chunk)
            for r, d in zip(rows, depths):
                r["depth"] = d
            results[caches.label(spec)].append({
                "length": length, "accuracy": sum(r["correct"] for r in rows) / len(rows),
                "key_logp": mean_key_logp(rows), "trials": rows})
    return {"lengths": list(lengths), "results": results}


def parse_lengths(text: str, max_len: int) -> list[int]:
    """'1024,2048' -> [1024, 2048], each in [64, max_len]."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not lengths:
        raise UsageError("--lengths is empty")
    for n in lengths:
        if not 64 <= n <= max_len:
            raise UsageError(f"--lengths {n}: must be in [64, {max_len}] (the model's "
                             "max_position_embeddings)")
    return lengths
