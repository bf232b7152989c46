"""Every ```python block of README.md runs as written (so the examples cannot rot).

A block that builds a device mesh (``make_mesh(``) runs in a fresh interpreter on 8 fake CPU
devices (the device count is fixed when jax starts); the others run in this process.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


def run_on_8_fake_devices(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on 8 fake CPU devices (this checkout first on sys.path)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(README.parent),
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    code += "\nassert jax.device_count() == 8, jax.devices()\n"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "make_mesh(" in BLOCKS[i]:
        proc = run_on_8_fake_devices(BLOCKS[i], tmp_path)
        assert proc.returncode == 0, f"README.md[python block {i}]:\n" + proc.stderr[-4000:]
        assert list(tmp_path.iterdir()) == []
        return
    ns: dict = {}
    exec(compile(BLOCKS[i], f"README.md[python block {i}]", "exec"), ns)
    # the examples write nothing where they run (e.g. not the CLI example's books.safetensors)
    assert list(tmp_path.iterdir()) == []
    if "step = jax.jit(step, donate_argnums=0)" in BLOCKS[i]:
        assert ns["cache"].lengths.tolist() == [8]
        assert ns["out"].shape == (2, 1, 8, 4, 64)
