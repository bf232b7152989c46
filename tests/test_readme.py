"""Every ```python block of README.md runs as written (so the examples cannot rot)."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(BLOCKS[i], f"README.md[python block {i}]", "exec"), ns)
    # the examples write nothing where they run (e.g. not the CLI example's books.safetensors)
    assert list(tmp_path.iterdir()) == []
    if "step = jax.jit(step, donate_argnums=0)" in BLOCKS[i]:
        assert ns["cache"].lengths.tolist() == [8]
        assert ns["out"].shape == (2, 1, 8, 4, 64)
