"""The two glob edge-case tests of fsspec's Get and Put classes (64
parametrizations, about 35 s against a live cluster) run in ``make soak``,
not ``make test``: they repeat on local paths (Put) and through get (Get)
the glob expansion over tierfs:// that AbstractCopyTests'
test_copy_glob_edge_cases already runs in make test. Everything else of
fsspec's abstract suite runs in make test."""

from __future__ import annotations

import pytest

SLOW = {("TestTierFSGet", "test_get_glob_edge_cases"), ("TestTierFSPut", "test_put_glob_edge_cases")}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and (cls.__name__, getattr(item, "originalname", "")) in SLOW:
            item.add_marker(pytest.mark.slow)
