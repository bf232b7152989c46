"""Both notebooks execute top to bottom on CPU with small settings (MILLION_JAX_SMALL=1)."""
from __future__ import annotations

import os
import pathlib

import pytest

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str):
    """Run a notebook in a fresh kernel that imports this checkout's packages (the kernel's
    cwd is notebooks/, so without PYTHONPATH it would import whatever copy is installed)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    saved = {k: os.environ.get(k) for k in ("MILLION_JAX_SMALL", "PYTHONPATH")}
    os.environ["MILLION_JAX_SMALL"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    try:
        client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


def test_first_cell_installs_only_when_missing():
    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code").source
    assert 'find_spec("million_app") is None' in first and "pip" in first


def test_kernels_notebook_runs():
    text = outputs(execute("kernels.ipynb"))
    assert "LUT scores == q . dequant(k)" in text
    assert "Pallas kernel (interpret)" in text


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_gguf")
def test_quickstart_notebook_runs():
    nb = execute("quickstart.ipynb")
    text = outputs(nb)
    assert "dense" in text and "ppl" in text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))


def test_bring_your_own_model_notebook_runs():
    text = outputs(execute("bring_your_own_model.ipynb"))
    assert "same parameters, same non-decode outputs" in text
    assert "smaller)" in text and "same next token at" in text
    assert "compiled decode steps: 1" in text
