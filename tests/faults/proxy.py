"""A userspace TCP fault proxy for tests (in the spirit of asyncpg's
``TCPFuzzingProxy``): it sits in front of a storage daemon's data-plane port
(or a meta gRPC port) and, on demand and per direction, passes, drops,
stalls, delays, resets or truncates the byte stream.

It runs an asyncio loop on its own background thread, so a test drives it
from synchronous code::

    with FaultProxy(("127.0.0.2", port), ("127.0.0.1", port)) as px:
        px.set("delay", delay=0.2)            # both directions
        px.set("stall", direction="down")     # answers stop coming back
        px.set("reset")                       # RST on the next chunk (SO_LINGER 0)
        px.set("truncate", nbytes=1000, direction="up")
        px.set("pass")

Directions: ``up`` is client -> server, ``down`` server -> client.

Modes (per direction; a change applies at once to existing connections):

* ``pass``      forward everything.
* ``drop``      blackhole: read and discard (the peer never sees the bytes).
* ``stall``     stop reading and forwarding, keep the connection open (TCP
                back-pressure builds up, like a hung process).
* ``delay``     forward each chunk after ``delay`` seconds (order kept).
* ``reset``     abort both sides with an RST (SO_LINGER 0) as soon as a chunk
                arrives in that direction; new connections in a direction set
                to reset are aborted on their first chunk too.
* ``truncate``  forward ``nbytes`` more bytes in that direction (a budget
                shared by all connections), then close the connection that
                used it up, and any later one the moment it sends.

:meth:`close` (or leaving the ``with`` block) stops the listener, aborts
every connection and joins the thread; nothing is left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DIRECTIONS", "MODES", "FaultProxy", "ProxyStats"]

Mode = Literal["pass", "drop", "stall", "delay", "reset", "truncate"]
Direction = Literal["up", "down", "both"]
MODES: tuple[str, ...] = ("pass", "drop", "stall", "delay", "reset", "truncate")
DIRECTIONS: tuple[str, ...] = ("up", "down")
_CHUNK = 256 << 10


@dataclass
class ProxyStats:
    """Counters, read from the test thread (approximate while traffic flows)."""

    accepted: int = 0
    forwarded: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    dropped: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    resets: int = 0
    truncations: int = 0


@dataclass
class _Rule:
    mode: str = "pass"
    delay: float = 0.0
    budget: int = 0  # truncate: bytes still allowed through
    changed: asyncio.Event | None = None  # set (and replaced) on every change


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Forward ``listen`` -> ``target`` with injectable faults (see module doc)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self.stats = ProxyStats()
        self._rules: dict[str, _Rule] = {"up": _Rule(), "down": _Rule()}
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        try:
            self._server = self._call(self._listen(listen))
        except BaseException:
            self._shutdown_loop()
            raise
        sock = self._server.sockets[0].getsockname()
        #: The address clients dial.
        self.address: tuple[str, int] = (sock[0], sock[1])

    # --- control (test thread) ---------------------------------------------------

    def set(self, mode: str, *, direction: str = "both", delay: float = 0.0, nbytes: int = 0) -> None:
        """Switch ``direction`` (``up``, ``down`` or ``both``) to ``mode``."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
        dirs = DIRECTIONS if direction == "both" else (direction,)
        if any(d not in DIRECTIONS for d in dirs):
            raise ValueError(f"unknown direction {direction!r} (up, down, both)")
        if mode == "delay" and delay <= 0:
            raise ValueError("delay mode needs delay > 0")
        if mode == "truncate" and nbytes < 0:
            raise ValueError("truncate needs nbytes >= 0")

        async def apply() -> None:
            for d in dirs:
                r = self._rules[d]
                r.mode, r.delay, r.budget = mode, delay, nbytes
                if r.changed is not None:
                    r.changed.set()
                r.changed = asyncio.Event()

        self._call(apply())

    def mode(self, direction: str) -> str:
        return self._rules[direction].mode

    def reset_all(self) -> int:
        """RST every open connection now; returns how many."""

        async def go() -> int:
            n = 0
            for a, b in list(self._conns):
                _rst(a)
                _rst(b)
                n += 1
            self.stats.resets += n
            return n

        n: int = self._call(go())
        return n

    def connections(self) -> int:
        async def go() -> int:
            return len(self._conns)

        n: int = self._call(go())
        return n

    def close(self) -> None:
        if not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._call(self._aclose())
            self._shutdown_loop()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loop thread ---------------------------------------------------------

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self, listen: tuple[str, int]) -> asyncio.Server:
        return await asyncio.start_server(self._accept, listen[0], listen[1], reuse_address=True)

    async def _aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for a, b in list(self._conns):
            a.transport.abort()
            b.transport.abort()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _spawn(self, coro: Any) -> None:
        t: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        try:
            sreader, swriter = await asyncio.wait_for(asyncio.open_connection(*self.target), 5.0)
        except (OSError, TimeoutError):
            _rst(cwriter)  # the server is gone: the client sees a reset, as it would without us
            return
        pair = (cwriter, swriter)
        self._conns.add(pair)
        ended: list[str] = []

        def finish(d: str = "") -> None:
            # A clean EOF in one direction half-closes; the pair goes when both
            # directions ended, or at once on an error, a reset or a truncation.
            if d and d not in ended:
                ended.append(d)
                if len(ended) < 2:
                    return
            if pair in self._conns:
                self._conns.discard(pair)
                for w in pair:
                    w.close()

        self._spawn(self._pump("up", creader, swriter, pair, finish))
        self._spawn(self._pump("down", sreader, cwriter, pair, finish))

    async def _pump(self, d: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter], finish: Callable[..., None]) -> None:
        rule: _Rule | None = self._rules[d]
        assert rule is not None
        try:
            while True:
                while rule.mode == "stall":  # stop reading: back-pressure, connection kept
                    ev = rule.changed
                    if ev is None:
                        rule.changed = ev = asyncio.Event()
                    await ev.wait()
                data = await reader.read(_CHUNK)
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    finish(d)
                    rule = None  # clean end: the finally below leaves the pair alone
                    return
                mode = rule.mode
                if mode == "stall":  # switched while we were reading: hold this chunk
                    while rule.mode == "stall":
                        ev = rule.changed
                        assert ev is not None
                        await ev.wait()
                    mode = rule.mode
                if mode == "drop":
                    self.stats.dropped[d] += len(data)
                    continue
                if mode == "reset":
                    self.stats.resets += 1
                    _rst(pair[0])
                    _rst(pair[1])
                    return
                if mode == "truncate":
                    n = min(rule.budget, len(data))
                    rule.budget -= n
                    if n:
                        writer.write(data[:n])
                        self.stats.forwarded[d] += n
                        with contextlib.suppress(ConnectionError):
                            await writer.drain()
                    if n < len(data) or rule.budget == 0:
                        self.stats.truncations += 1
                        finish()
                        return
                    continue
                if mode == "delay":
                    await asyncio.sleep(rule.delay)
                writer.write(data)
                self.stats.forwarded[d] += len(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            raise
        finally:
            if rule is not None:
                finish()
