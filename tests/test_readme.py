"""The README's Python examples run as written, and each one is checked for what it claims.

Checks are keyed by what a block does, not by where it sits: ``CHECKS`` maps a name to the
strings that identify its block (all must be in it, and in no other block) and to the
assertions on the names the block defines. So blocks may move, be reworded around, or be
reordered, but:

* a checked block that disappears (its strings are in no block) fails its check loudly;
* a new ```python block that no check claims fails ``test_every_python_block_is_claimed``
  until it gets a check here or is listed in ``NOT_RUN`` with the reason;
* every check compares what the block computed against a reference computed here.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
PYTHON_TAGS = {"python", "py", "python3", "pycon"}


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced code blocks whose info string is a Python language tag."""
    blocks = re.findall(r"^ {0,3}(```+|~~~+)[ \t]*([^\n`]*)\n(.*?)^ {0,3}\1[ \t]*$", text, flags=re.S | re.M)
    return [body for _, info, body in blocks if info.split() and info.split()[0].lower() in PYTHON_TAGS]


# ---------------------------------------------------------------------------- the checks
def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check_our_llama(ns: Mapping[str, Any]) -> None:
    """PQ-cache prefill + decode on our LLaMA follows the same steps on a dense cache."""
    from models import decode_step, init_cache, prefill

    cfg, params = ns["cfg"], ns["params"]
    assert ns["cache"].lengths.tolist() == [5]
    dense = init_cache(cfg, 1, 32, dtype=jnp.float32)
    _, dense = prefill(cfg, params, dense, jnp.array([[5, 6, 7, 8]]), jnp.array([4]))
    ref, _ = decode_step(cfg, params, dense, jnp.array([9]))
    assert ns["next_logits"].shape == ref.shape == (1, cfg.vocab)
    assert _rel(ns["next_logits"], ref) < 0.1, _rel(ns["next_logits"], ref)


def _check_flax_nnx(ns: Mapping[str, Any]) -> None:
    """The drop-in layer's decode step (read from codes) matches the stock full attention."""
    attn, x = ns["attn"], ns["x"]
    assert attn.lengths[...].tolist() == [9]
    ref = attn(x[:, :9], decode=False)[:, -1:]  # no mask: the last query sees all 9 tokens
    assert ns["y"].shape == ref.shape == (1, 1, 32)
    assert _rel(ns["y"], ref) < 0.05, _rel(ns["y"], ref)


def _check_pq(ns: Mapping[str, Any]) -> None:
    """Codes and reconstruction have the commented shapes; the file round-trips the books."""
    x, books, codes, x_hat = ns["x"], ns["books"], ns["codes"], ns["x_hat"]
    assert codes.dtype == np.uint8 and codes.shape == (2, 4096, 64)
    assert x_hat.shape == x.shape and _rel(x_hat, x) < 0.3, _rel(x_hat, x)
    assert ns["bits_per_element"](128, 64, 8) == 64 * 8 / 128
    assert ns["meta"]["note"] == "anything JSON"
    np.testing.assert_array_equal(np.asarray(ns["books2"]["key"].centroids), np.asarray(books.centroids))


def _check_own_model(ns: Mapping[str, Any]) -> None:
    """The hand-written layer scan over the cache: out per layer equals attention from the
    cache's own reconstruction of what was written (window exact, the rest from codes)."""
    assert ns["cache"].lengths.tolist() == [8]
    L, B, H, d = ns["L"], ns["B"], ns["H"], ns["d"]
    q, kv, out = ns["q"], ns["kv"], ns["out"]
    assert out.shape == (L, B, q.shape[2], H, d)
    # all 8 new tokens sit in the exact window / sinks (window 16 + sinks 4 >= 8): exact causal
    # attention over them, each query head reading its group's kv head
    g = H // kv.shape[3]
    k = jnp.repeat(kv, g, axis=3)
    s = jnp.einsum("lbqhd,lbkhd->lbhqk", q, k) / np.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((q.shape[2], q.shape[2]), bool)), s, -jnp.inf)
    ref = jnp.einsum("lbhqk,lbkhd->lbqhd", jax.nn.softmax(s, axis=-1), k)
    assert _rel(out, ref) < 1e-4, _rel(out, ref)


@dataclasses.dataclass(frozen=True)
class Check:
    """A README block, found by strings it must contain, and what to assert after it ran."""

    anchors: tuple[str, ...]
    check: Callable[[Mapping[str, Any]], None]
    slow: bool = False  # measured >= 45 s under load ~10 on 2 shared cores (-m "not slow" skips it)


CHECKS: dict[str, Check] = {
    "our-llama: calibrate from a dense prefill, decode from a PQ cache":
        Check(("collect_kv(", "fit_kv_codebooks(", "decode_step("), _check_our_llama, slow=True),
    "flax-nnx: drop-in PQMultiHeadAttention":
        Check(("PQMultiHeadAttention(", "calibrate_nnx("), _check_flax_nnx, slow=True),
    "pq: fit / encode / decode / save / load codebooks":
        Check(("fit_codebooks(", "encode(", "save_codebooks(", "load_codebooks("), _check_pq),
    "own-model: cache.attend in a scan, cache.write after it":
        Check(("cache.attend(", "cache.write("), _check_own_model, slow=True),
}

# Python blocks deliberately not run, as {string that identifies the block: why}.
NOT_RUN: dict[str, str] = {}


def claim(blocks: Sequence[str], checks: Mapping[str, Check],
          not_run: Mapping[str, str]) -> tuple[dict[str, int], list[str]]:
    """(check name -> index of its block, problems): every check must find exactly one block,
    every ``not_run`` entry exactly one, and every block must be claimed exactly once."""
    owners: list[list[str]] = [[] for _ in blocks]
    found, problems = {}, []
    claims = [(name, c.anchors) for name, c in checks.items()] + [
        (f"NOT_RUN[{s!r}]", (s,)) for s in not_run]
    for name, anchors in claims:
        hits = [i for i, b in enumerate(blocks) if all(a in b for a in anchors)]
        if len(hits) != 1:
            problems.append(f"{name}: {len(hits)} README python blocks contain all of {anchors} "
                            f"(blocks {hits}); it must be exactly one")
            continue
        owners[hits[0]].append(name)
        found[name] = hits[0]
    for i, (b, who) in enumerate(zip(blocks, owners)):
        head = b.strip().splitlines()[0] if b.strip() else ""
        if not who:
            problems.append(f"README python block {i} ({head!r}...) is neither checked nor listed: "
                            "add a Check to CHECKS in tests/test_readme.py or list it in NOT_RUN")
        elif len(who) > 1:
            problems.append(f"README python block {i} ({head!r}...) is claimed by {who}")
    return found, problems


BLOCKS = python_blocks(README.read_text())
FOUND, PROBLEMS = claim(BLOCKS, CHECKS, NOT_RUN)


def test_every_python_block_is_claimed():
    assert BLOCKS, "README.md has no ```python block"
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if c.slow else n
                                  for n, c in CHECKS.items()])
def test_readme_block(name, tmp_path, monkeypatch):
    assert name in FOUND, f"the README block of check {name!r} is gone or ambiguous: " + "; ".join(
        p for p in PROBLEMS if p.startswith(name))
    i = FOUND[name]
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    exec(compile(BLOCKS[i], f"README.md[python block {i}: {name}]", "exec"), ns)
    # the examples write nothing where they run
    assert list(tmp_path.iterdir()) == []
    CHECKS[name].check(ns)


# ---------------------------------------------------------------------------- self-checks
_SYNTHETIC = """\
Intro.

```python
a = 1  # block 0: fit_codebooks(
```

```bash
echo not python
```

~~~py
b = 2  # block 1: cache.attend(
~~~

```python
c = 3  # block 2: new
```
"""


def test_self_check_blocks_and_claims():
    blocks = python_blocks(_SYNTHETIC)
    assert [b.split()[0] for b in blocks] == ["a", "b", "c"]
    checks = {"fit": Check(("fit_codebooks(",), lambda ns: None),
              "attend": Check(("cache.attend(",), lambda ns: None)}
    found, problems = claim(blocks, checks, {})
    assert found == {"fit": 0, "attend": 1}
    assert len(problems) == 1 and "block 2 ('c = 3" in problems[0] and "neither" in problems[0]
    # listing the new block silences it; a vanished or doubled anchor is loud
    assert claim(blocks, checks, {"c = 3": "why"})[1] == []
    vanished = dict(checks, gone=Check(("nowhere(",), lambda ns: None))
    assert any(p.startswith("gone: 0 README python blocks") for p in claim(blocks, vanished, {"c = 3": ""})[1])
    doubled = dict(checks, both=Check(("# block",), lambda ns: None))
    assert any(p.startswith("both: 3 README python blocks") for p in claim(blocks, doubled, {"c = 3": ""})[1])
    overlap = dict(checks, again=Check(("a = 1",), lambda ns: None))
    assert any("claimed by ['fit', 'again']" in p for p in claim(blocks, overlap, {"c = 3": ""})[1])
