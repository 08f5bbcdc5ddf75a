"""free_ports: the ports a local cluster is planned with."""

from __future__ import annotations

import socket

import pytest

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
