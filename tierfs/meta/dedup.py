"""The retry-deduplication table of the meta state machine.

For each client (``MetaOp.client_id``) it keeps the results of that client's
most recent successful requests, so that a retried request answers with the
first result instead of being applied twice (docs/meta.md, "MetaClient:
retries and idempotency"). It is replicated state: every replica must keep
and evict exactly the same entries, so nothing here reads a clock or depends
on anything but the sequence of calls.

Bounded three ways:

* per client, the last :data:`REQUESTS_PER_CLIENT` request ids (ops of
  format :data:`~tierfs.meta.state.DEDUP_WINDOW_FORMAT` on; older ones
  :data:`REQUESTS_PER_CLIENT_OLD`, fewer than a Batch call's 256 items, so
  a retried batch was applied again in part); a client keeps the request
  ids it has in flight within :data:`REQUEST_SPREAD` of each other
  (``MetaClient``), so none of them is dropped before its last retry;
* in total, :data:`MAX_ENTRIES` results and :data:`MAX_BYTES` bytes of
  results: past either, the least recently active clients are forgotten,
  oldest first (clients are kept in the order of their latest request, so
  this is the same on every replica and after a snapshot restore);
* per entry, :data:`MAX_RESULT_BYTES`: a larger result is not kept; a retry
  of that request is answered with an error saying so (it was applied once).

Clients idle for :data:`REQUEST_TTL_NS` are forgotten by the tick.

Each result of an op of format :data:`~tierfs.meta.state.DEDUP_BOUND_FORMAT`
or later is kept with a fingerprint of what it answered (the op's kind and
the identity meta authenticated): a request id used again for another kind
of request, or by another caller, is refused rather than answered with the
first reply (a client id and a request id are chosen by the client, so
neither proves a retry).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_BYTES", "MAX_ENTRIES", "MAX_RESULT_BYTES", "REQUESTS_PER_CLIENT", "REQUESTS_PER_CLIENT_OLD",
           "REQUEST_SPREAD", "REQUEST_TTL_NS", "RequestTable"]

REQUESTS_PER_CLIENT = 4096
REQUESTS_PER_CLIENT_OLD = 128
#: The most a client's request ids in flight may differ (MetaClient waits
#: before taking a new id past it): half the window, so that the results of
#: every request a client may still retry are among those kept.
REQUEST_SPREAD = REQUESTS_PER_CLIENT // 2
MAX_ENTRIES = 65_536
MAX_BYTES = 32 << 20
MAX_RESULT_BYTES = 64 << 10
REQUEST_TTL_NS = 15 * 60 * 10**9


@dataclass(slots=True)
class _Client:
    last_seen: int
    # request id -> serialized MetaResult, or None: applied, result too large to keep
    results: dict[int, bytes | None] = field(default_factory=dict)
    size: int = 0
    # request id -> fingerprint of the op that gave the result (absent for
    # ops of older formats, which kept none)
    prints: dict[int, str] = field(default_factory=dict)


def _cost(out: bytes | None) -> int:
    return len(out) if out is not None else 0


class RequestTable:
    """client id -> its recent results, least recently active client first."""

    def __init__(self) -> None:
        self._clients: dict[str, _Client] = {}
        self.entries = 0
        self.bytes = 0

    def __contains__(self, client: object) -> bool:
        return client in self._clients

    def __len__(self) -> int:
        return len(self._clients)

    def lookup(self, client: str, request_id: int) -> tuple[bool, bytes | None, str | None]:
        """(found, result, fingerprint); result None: applied, but its result
        was not kept; fingerprint None: kept by an op of an older format."""
        c = self._clients.get(client)
        if c is None or request_id not in c.results:
            return False, None, None
        return True, c.results[request_id], c.prints.get(request_id)

    def remember(self, client: str, request_id: int, out: bytes, clock: int, fingerprint: str | None = None,
                 window: int = REQUESTS_PER_CLIENT) -> None:
        c = self._clients.pop(client, None)
        if c is None:
            c = _Client(last_seen=clock)
        self._clients[client] = c  # now the most recently active
        c.last_seen = clock
        kept: bytes | None = out if len(out) <= MAX_RESULT_BYTES else None
        if request_id in c.results:
            self._drop(c, request_id)
        c.results[request_id] = kept
        if fingerprint is not None:
            c.prints[request_id] = fingerprint
        c.size += _cost(kept)
        self.entries += 1
        self.bytes += _cost(kept)
        if len(c.results) > window:
            extra = len(c.results) - window
            # The lowest ids go first (min, not a sort per op: the window
            # is thousands of ids, and it is over by one at a time).
            for old in ([min(c.results)] if extra == 1 else sorted(c.results)[:extra]):
                self._drop(c, old)
        while (self.entries > MAX_ENTRIES or self.bytes > MAX_BYTES) and len(self._clients) > 1:
            self._forget(next(iter(self._clients)))

    def _drop(self, c: _Client, request_id: int) -> None:
        out = c.results.pop(request_id)
        c.prints.pop(request_id, None)
        c.size -= _cost(out)
        self.entries -= 1
        self.bytes -= _cost(out)

    def _forget(self, client: str) -> None:
        c = self._clients.pop(client)
        self.entries -= len(c.results)
        self.bytes -= c.size

    def expire_due(self, before: int) -> bool:
        """Whether some client was last seen before ``before`` (O(1): the
        least recently active client is first)."""
        return bool(self._clients) and next(iter(self._clients.values())).last_seen < before

    def expire(self, before: int) -> None:
        """Forget the clients last seen before ``before``."""
        while self.expire_due(before):
            self._forget(next(iter(self._clients)))

    # ---- snapshot encoding ------------------------------------------------------

    def to_json(self) -> list[list[Any]]:
        """In activity order (it decides evictions, so it is part of the state)."""
        return [[client, c.last_seen,
                 [[r, None if v is None else base64.b64encode(v).decode()] for r, v in sorted(c.results.items())]]
                for client, c in self._clients.items()]

    def prints_to_json(self) -> list[list[Any]]:
        """The fingerprints, apart from :meth:`to_json` (a state that kept
        none encodes as it did before they existed): [[client, [[request
        id, fingerprint], ...]], ...] for the clients with any."""
        return [[client, [[r, c.prints[r]] for r in sorted(c.prints)]]
                for client, c in self._clients.items() if c.prints]

    def load_prints(self, doc: list[list[Any]]) -> None:
        for client, items in doc:
            c = self._clients.get(client)
            if c is None:
                continue
            for r, fp in items:
                if r in c.results:
                    c.prints[r] = fp

    @classmethod
    def from_json(cls, doc: list[list[Any]], *, ordered: bool = True) -> RequestTable:
        """``ordered=False``: a snapshot from before the table was bounded
        (sorted by client id): put the clients in activity order by last seen."""
        rows = doc if ordered else sorted(doc, key=lambda row: (row[1], row[0]))
        t = cls()
        for client, last_seen, items in rows:
            c = t._clients[client] = _Client(last_seen=last_seen)
            for r, v in items:
                out = None if v is None else base64.b64decode(v)
                c.results[r] = out
                c.size += _cost(out)
                t.entries += 1
                t.bytes += _cost(out)
        return t
