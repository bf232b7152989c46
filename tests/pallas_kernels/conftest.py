"""Every test in this directory is a Pallas kernel test: it gets the ``kernels`` marker here
(``pytest -m kernels`` selects them; ``make test`` runs them again under Python 3.12 + jax 0.11.2)."""

from __future__ import annotations

import pathlib

import pytest

_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest calls this hook with every collected item, not only this directory's
    for item in items:
        if _HERE in pathlib.Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.kernels)
