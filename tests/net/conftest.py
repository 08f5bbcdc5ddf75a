"""Fixtures for the data-plane tests (helpers live in dataplane_helpers)."""

from __future__ import annotations

import pytest
from dataplane_helpers import TRANSPORTS


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Every transport that can run here (rdma skips without a device)."""
    return str(request.param)
