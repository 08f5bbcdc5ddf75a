"""free_ports: the ports a local cluster is planned with."""

from __future__ import annotations

import socket

import pytest

from tierfs.errors import ConfigError
from tierfs.local import _ephemeral_range, free_ports

pytestmark = pytest.mark.timeout(30)


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    lo, _ = _ephemeral_range()
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert all(1024 < p < lo for p in ports)
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            socks.append(s)
    finally:
        for s in socks:
            s.close()


def test_outgoing_connections_never_take_a_planned_port() -> None:
    """What broke CI: a port chosen by binding port 0 is an ephemeral port, and
    a client's outgoing connection could take it before the daemon bound it."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        addr = srv.getsockname()
        planned = set(free_ports(20))
        conns = [socket.create_connection(addr) for _ in range(50)]
        try:
            assert not planned & {c.getsockname()[1] for c in conns}
        finally:
            for c in conns:
                c.close()


def test_port_range_variable_narrows_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """TIERFS_PORT_RANGE: what keeps parallel test workers' ports apart."""
    monkeypatch.setenv("TIERFS_PORT_RANGE", "23000-23099")
    ports = free_ports(30)
    assert len(set(ports)) == 30 and all(23000 <= p <= 23099 for p in ports)
    for bad in ("23000", "x-y", "80-90", "30000-20000"):
        monkeypatch.setenv("TIERFS_PORT_RANGE", bad)
        with pytest.raises(ConfigError, match="TIERFS_PORT_RANGE"):
            free_ports(1)


def test_xdist_workers_get_disjoint_slices() -> None:
    """make test runs two pytest-xdist workers: tests/conftest.py gives each
    its own slice, and this process (a worker, or not) sees its own."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker:
        assert "PYTEST_XDIST_WORKER_COUNT" not in os.environ
        return
    lo, hi = (int(x) for x in os.environ["TIERFS_PORT_RANGE"].split("-"))
    width = hi - lo + 1
    i = int(worker[2:])
    assert width >= 1000 and lo == 10000 + i * width
    assert all(lo <= p <= hi for p in free_ports(20))
