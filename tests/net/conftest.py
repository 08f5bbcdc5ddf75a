"""Fixtures for the data-plane tests (helpers live in dataplane_helpers)."""

from __future__ import annotations

import pytest
from dataplane_helpers import TRANSPORTS, transport_params, use_transport


@pytest.fixture(params=transport_params(TRANSPORTS))
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every transport that can run here (rdma skips without a device), each
    with and without the receive offload (dataplane_helpers.OFFLOAD)."""
    return use_transport(request, monkeypatch)
