"""MetaClient: the async client of the metadata service.

It talks to whichever meta replica it believes leads, follows a
NotLeaderError's leader hint at once, and retries unavailable replicas and
timeouts with exponential backoff until the per-call ``deadline`` runs out,
then raises ``UnavailableError("cluster unreachable: tried A, B, C")``. Every
failure surfaces as a TierFSError (via :func:`tierfs.errors.from_grpc`),
never as a raw gRPC error.

Retry safety: every mutating call carries this client's id and a fresh
request id (gRPC metadata); a retry of the same call reuses them, and the
state machine answers a request id it has already applied with the first
result. So a create retried after a leader change returns the file it made,
not AlreadyExistsError; an unlink retried does not fail with NotFoundError.
The memory is bounded (the last 128 requests of a client, forgotten after 15
idle minutes), far beyond one call's retry window.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import itertools
import math
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

import grpc
from google.protobuf.message import Message

from tierfs.errors import (
    InternalError,
    InvalidArgumentError,
    NotLeaderError,
    TierFSError,
    TimeoutError_,
    UnavailableError,
    UnsupportedError,
    error_from_code,
    from_grpc,
)
from tierfs.meta.auth import bearer, resolve_token
from tierfs.meta.dedup import REQUEST_SPREAD
from tierfs.meta.ops import MAX_BATCH_ITEMS
from tierfs.meta.wire import BATCH_RPCS, CLIENT_ID_KEY, LEADER_KEY, REQUEST_ID_KEY
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import meta_pb2_grpc
from tierfs.tls import TlsFiles, TlsStamp, grpc_channel, resolve_client_tls, unreachable_hint

__all__ = ["MetaClient", "Where"]

#: An existing object: absolute path, inode id, or (parent inode, name).
Where = str | int | tuple[int, str]
_R = TypeVar("_R", bound=Message)
_C = TypeVar("_C")


#: The BatchItem field of each RPC that may travel in a Batch call.
_BATCH_FIELD = {rpc: field for field, rpc in BATCH_RPCS.items()}
#: A Batch item that failed with one of these is sent again on its own
#: (same request id), through the retry loop of a single call.
_RETRY_ALONE = (NotLeaderError, UnavailableError, TimeoutError_)


class _Queued:
    """A mutation waiting to travel in the next Batch call."""

    __slots__ = ("fut", "method", "reply_cls", "req", "rid")

    def __init__(self, method: str, req: Message, reply_cls: type[Message], rid: int,
                 fut: asyncio.Future[Message]) -> None:
        self.method, self.req, self.reply_cls, self.rid, self.fut = method, req, reply_cls, rid, fut

    def item(self) -> pb.BatchItem:
        item = pb.BatchItem(request_id=self.rid)
        getattr(item, _BATCH_FIELD[self.method]).CopyFrom(self.req)
        return item

    def fail(self, err: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(err)

    def done(self, reply: Message) -> None:
        if not self.fut.done():
            self.fut.set_result(reply)


def _harvest(reply: Message, sink: Callable[[bytes], None]) -> None:
    if isinstance(reply, pb.FileInfo):
        if reply.capability:
            sink(reply.capability)
    elif isinstance(reply, pb.OpenWriteReply):
        for raw in (reply.file.capability, reply.write_capability):
            if raw:
                sink(raw)
    elif isinstance(reply, pb.RenewLeaseReply) and reply.write_capability:
        sink(reply.write_capability)


def _lifetime_ms(expires: float) -> int:
    """A token lifetime in seconds as the ms the request carries, where 0
    means "never": a positive lifetime under 1 ms is 1 ms, not 0 (until stop
    48 ``--expires 0.0004`` made a token that never expired)."""
    return math.ceil(expires * 1000) if expires > 0 else int(expires * 1000)


def _loc(where: Where) -> pb.Loc:
    if isinstance(where, str):
        return pb.Loc(path=where)
    if isinstance(where, tuple):
        return pb.Loc(parent=where[0], name=where[1])
    if isinstance(where, int) and not isinstance(where, bool):
        return pb.Loc(inode=where)
    raise InvalidArgumentError(f"expected a path, an inode id or (parent, name), got {where!r}")


def _layout(layout: pb.Layout | None, chunk_size: int, redundancy: str, stripe_width: int) -> pb.Layout | None:
    if layout is not None:
        return layout
    if chunk_size or redundancy or stripe_width:
        return pb.Layout(chunk_size=chunk_size, redundancy=redundancy, stripe_width=stripe_width)
    return None


def _range_checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with protobuf's bare "Value out of range: -1" (an argument that
    does not fit its field, e.g. a negative size or id) turned into an
    InvalidArgumentError that names the argument; nothing was sent."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    async def checked(self: Any, *args: Any, **kw: Any) -> Any:
        try:
            return await fn(self, *args, **kw)
        except ValueError as exc:
            if not str(exc).startswith("Value out of range"):
                raise
            try:
                bound = sig.bind(self, *args, **kw).arguments
            except TypeError:
                bound = {}
            bad = [f"{k} {v}" for k, v in bound.items()
                   if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v < 1 << 64]
            what = ", ".join(bad) if bad else f"a value ({str(exc).rpartition(':')[2].strip()})"
            raise InvalidArgumentError(f"{fn.__name__}: {what} is out of range") from None

    return checked


def _check_ranges(cls: type[_C]) -> type[_C]:
    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(fn):
            setattr(cls, name, _range_checked(fn))
    return cls


@_check_ranges
class MetaClient:
    """Async client for the meta service. ``addrs``: gRPC addresses of the
    meta replicas (host:port). ``deadline``: seconds one call may spend in
    total, retries included; ``attempt_timeout``: seconds one attempt may
    take before the next replica is tried."""

    def __init__(
        self,
        addrs: Sequence[str],
        *,
        deadline: float = 10.0,
        attempt_timeout: float = 3.0,
        client_id: str | None = None,
        backoff_initial: float = 0.05,
        backoff_max: float = 1.0,
        token: str | None = None,
        token_file: str | None = None,
        data_dir: str | None = "./.tierfs",
        tls: TlsFiles | Literal["auto"] | None = "auto",
        mutations_in_flight: int = 2,
    ) -> None:
        """``mutations_in_flight``: namespace mutations (mkdir, rename,
        unlink, rmdir, symlink) this client has in flight before further
        ones wait and then travel together in one ``Batch`` call, each with
        its own request id, result and error (docs/meta.md, "Batched
        mutations"); 0 sends every call on its own. ``token``/``token_file``/``data_dir``: the credential every call
        carries, chosen by :func:`tierfs.meta.auth.resolve_token` (a token
        given, even "" or a wrong one, is used as is). ``tls``: the CA (and
        client certificate) to dial the replicas with; "auto":
        :func:`tierfs.tls.resolve_client_tls` (TIERFS_TLS_CA, the tls/ca.pem
        of the local cluster these addresses belong to); None: plaintext."""
        if not addrs:
            raise InvalidArgumentError("MetaClient needs at least one meta address")
        self.addrs: list[str] = list(dict.fromkeys(addrs))
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout
        self.client_id = client_id or uuid.uuid4().hex
        self._backoff = (backoff_initial, backoff_max)
        self._leader = self.addrs[0]
        #: replicas that failed to answer (unavailable, timed out): loop
        #: time until which they are not preferred
        self._unreachable: dict[str, float] = {}
        #: seconds a replica that did not answer is passed over
        self.unreachable_for = 5.0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Any] = {}
        self._req = itertools.count(1)
        #: Request ids of mutations in flight (taken, not finished), oldest
        #: first, and an event set when one finishes (see _new_rid).
        self._rids: dict[int, None] = {}
        self._rid_freed = asyncio.Event()
        self._last_rid = 0
        self._closed = False
        #: Called with every data-plane capability a reply carries (FileInfo,
        #: OpenWriteReply, RenewLeaseReply): the data client keeps them.
        self.capability_sink: Callable[[bytes], None] | None = None
        self.token = resolve_token(token, token_file, data_dir)
        self.tls: TlsFiles | None = resolve_client_tls(addrs=self.addrs) if tls == "auto" else tls
        self._tls_stamp = TlsStamp(self.tls)
        self._closing: set[asyncio.Task[None]] = set()
        self.mutations_in_flight = mutations_in_flight
        self._mut_busy = 0
        self._mut_queue: collections.deque[_Queued] = collections.deque()
        self._mut_send_scheduled = False
        self._batch_tasks: set[asyncio.Task[None]] = set()
        #: the leader answered Batch with UnsupportedError (an older
        #: version): every mutation goes on its own from then on
        self._batch_unsupported = False
        #: Batch calls made, and the mutations they carried (diagnostics)
        self.batch_calls = 0
        self.batched_ops = 0

    # ---- lifecycle ----------------------------------------------------------

    async def close(self) -> None:
        self._closed = True
        while self._mut_queue:
            self._mut_queue.popleft().fail(UnavailableError("MetaClient is closed"))
        for task in list(self._batch_tasks):
            task.cancel()
        if self._batch_tasks:
            await asyncio.gather(*self._batch_tasks, return_exceptions=True)
        channels, self._channels, self._stubs = self._channels, {}, {}
        for ch in channels.values():
            await ch.close(None)
        for task in list(self._closing):
            task.cancel()

    async def __aenter__(self) -> MetaClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def leader(self) -> str:
        """The replica the next call goes to first."""
        return self._leader

    def _stub(self, addr: str) -> Any:
        if self._closed:
            raise UnavailableError("MetaClient is closed")
        if self._tls_stamp.changed():
            # Renewed TLS files: channel credentials are fixed, so new
            # channels; the old ones finish what is in flight on them.
            old, self._channels, self._stubs = self._channels, {}, {}
            for ch in old.values():
                task = asyncio.get_running_loop().create_task(ch.close(30.0))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        stub = self._stubs.get(addr)
        if stub is None:
            ch = grpc_channel(addr, self.tls, options=[("grpc.enable_retries", 0)])
            self._channels[addr] = ch
            stub = self._stubs[addr] = meta_pb2_grpc.MetaServiceStub(ch)
        return stub

    # ---- request ids --------------------------------------------------------------

    async def _new_rid(self) -> int:
        """A request id for a new mutation, once it is within REQUEST_SPREAD
        of the oldest still in flight: meta keeps a client's last
        REQUESTS_PER_CLIENT results for retries, so a request retried after
        a lost reply finds its first result instead of being applied again
        (a Batch call alone carries 256; until stop 47 meta kept 128 and
        nothing held a client back)."""
        while self._rids and self._last_rid + 1 - next(iter(self._rids)) >= REQUEST_SPREAD:
            freed = self._rid_freed
            await freed.wait()
        rid = self._last_rid = next(self._req)
        self._rids[rid] = None
        return rid

    def _untracked_rid(self) -> int:
        rid = self._last_rid = next(self._req)
        return rid

    def _free_rid(self, rid: int) -> None:
        if self._rids.pop(rid, 0) is None:
            freed, self._rid_freed = self._rid_freed, asyncio.Event()
            freed.set()

    # ---- the retry loop -------------------------------------------------------

    async def _call(self, method: str, req: Message, reply_cls: type[_R], *, mutating: bool = False,
                    addr: str | None = None, attempt_timeout: float | None = None,
                    token: str | None = None, request_id: int | None = None,
                    deadline: float | None = None) -> _R:
        """``deadline``: this call's own bound on its retries, when shorter
        than the client's."""
        loop = asyncio.get_running_loop()
        end = loop.time() + (self.deadline if deadline is None else max(0.0, min(deadline, self.deadline)))
        md = bearer(self.token if token is None else token)
        own = 0
        if mutating:
            if request_id is None:
                rid = own = await self._new_rid()
            else:
                rid = request_id
            md += ((CLIENT_ID_KEY, self.client_id), (REQUEST_ID_KEY, str(rid)))
        try:
            return cast(_R, await self._attempts(method, req, md, end, addr, attempt_timeout))
        finally:
            if own:
                self._free_rid(own)

    async def _attempts(self, method: str, req: Message, md: Any, end: float, addr: str | None,
                        attempt_timeout: float | None) -> Any:
        loop = asyncio.get_running_loop()
        target = addr or self._leader
        tried: list[str] = []
        # Replicas that answered "not the leader" (with the leader they
        # named), and those that did not answer, in this call: for its error.
        not_leader: dict[str, str] = {}
        down: set[str] = set()
        last = ""
        delay = self._backoff[0]
        hops = 0
        while True:
            remaining = end - loop.time()
            if remaining <= 0:
                leaderless = [t for t, hint in not_leader.items()
                              if not hint or hint in down or self._is_unreachable(hint)]
                if leaderless:
                    # A replica answered, but knows no leader: that is the
                    # news, not the refused connection of the one asked last.
                    raise UnavailableError(
                        f"cluster unreachable: no meta leader: {', '.join(leaderless)} answer"
                        f"{'s' if len(leaderless) == 1 else ''}, but know{'s' if len(leaderless) == 1 else ''} no "
                        f"leader that answers (a leader needs a majority of the meta replicas up and in touch; `tierfs status` "
                        f"shows which answer); tried {', '.join(tried)}"
                        + (f" (last error: {last}{unreachable_hint(last, self.tls)})"
                           if last and not last.startswith("not the leader") else ""))
                raise UnavailableError(f"cluster unreachable: tried {', '.join(tried) or target}"
                                       + (f" (last error: {last}{unreachable_hint(last, self.tls)})"
                                          if last else ""))
            if target not in tried:
                tried.append(target)
            full = attempt_timeout or self.attempt_timeout
            try:
                call = getattr(self._stub(target), method)(req, timeout=min(remaining, full), metadata=md)
                reply = await call
                if addr is None:
                    self._leader = target
                    self._unreachable.pop(target, None)
                    self._prefer_leader(target, await call.trailing_metadata())
                if self.capability_sink is not None:
                    _harvest(reply, self.capability_sink)
                return reply  # type: ignore[no-any-return]
            except grpc.RpcError as exc:
                err = from_grpc(exc)
            if isinstance(err, NotLeaderError) and addr is None:
                last = str(err)
                not_leader[target] = err.leader
                if err.leader and err.leader != target and hops < 2 * len(self.addrs) + 2 \
                        and not self._is_unreachable(err.leader):
                    # Follow the hint at once; bounded so two replicas that
                    # disagree during an election cannot ping-pong us forever.
                    hops += 1
                    if err.leader not in self.addrs:
                        self.addrs.append(err.leader)
                    target = self._leader = err.leader
                    continue
                target = self._next(target)
            elif isinstance(err, (UnavailableError, TimeoutError_)):
                if isinstance(err, UnavailableError) or target not in not_leader:
                    # (a replica that said "not the leader" and then held a
                    # call past its attempt's time waits for a leader: it is
                    # up, and its answer stands)
                    down.add(target)
                    not_leader.pop(target, None)
                cut_short = isinstance(err, TimeoutError_) and remaining < full
                if not (last and cut_short):
                    # An attempt that the call's own deadline cut short and
                    # that timed out tells less than the error before it
                    # (a follower's "not the leader"): that one is reported.
                    last = str(err)
                if addr is None and cut_short:
                    # Nor does it show the replica is down (it got less
                    # than an attempt's time): the next call may try it.
                    target = self._next(target)
                elif addr is None:
                    self._unreachable[target] = loop.time() + self.unreachable_for
                    target = self._next(target)
            else:
                raise err
            if addr is None and target not in tried:
                # A replica not asked yet in this call: at once (a dead
                # leader's survivors hold the call until the next leader is
                # elected, then forward it: no sleep needed to find it).
                continue
            await asyncio.sleep(min(delay, max(0.0, end - loop.time())) * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self._backoff[1])
            hops = 0

    # ---- batched mutations (docs/meta.md, "Batched mutations") -----------------

    async def _mutate(self, method: str, req: Message, reply_cls: type[_R]) -> _R:
        """A namespace mutation: on its own while fewer than
        ``mutations_in_flight`` are in flight, else queued for the next
        Batch call. Either way it keeps its request id across retries."""
        limit = self.mutations_in_flight
        # The id first, before a batch slot is taken: waiting for it while
        # holding one could wait on a queued mutation that needs that slot.
        rid = await self._new_rid()
        if limit <= 0 or self._batch_unsupported or (self._mut_busy < limit and not self._mut_queue):
            self._mut_busy += 1
            try:
                return await self._call(method, req, reply_cls, mutating=True, request_id=rid)
            finally:
                self._free_rid(rid)
                self._mut_busy -= 1
                self._schedule_batch()
        if self._closed:
            self._free_rid(rid)
            raise UnavailableError("MetaClient is closed")
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda _f: self._free_rid(rid))
        self._mut_queue.append(_Queued(method, req, reply_cls, rid, fut))
        self._schedule_batch()
        reply = await fut
        assert isinstance(reply, reply_cls)
        return reply

    def _schedule_batch(self) -> None:
        if self._mut_queue and not self._mut_send_scheduled and self._mut_busy < self.mutations_in_flight:
            # After the callbacks already due, so that the calls made in
            # this turn of the loop travel together.
            self._mut_send_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_batch)

    def _send_batch(self) -> None:
        self._mut_send_scheduled = False
        if self._mut_busy >= self.mutations_in_flight or self._closed:
            return
        take: list[_Queued] = []
        while self._mut_queue and len(take) < MAX_BATCH_ITEMS:
            q = self._mut_queue.popleft()
            if not q.fut.done():  # its caller gave up (cancelled) while it waited
                take.append(q)
        if not take:
            return
        self._mut_busy += 1
        task = asyncio.get_running_loop().create_task(self._run_batch(take))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_batch(self, take: list[_Queued]) -> None:
        try:
            if len(take) == 1 or self._batch_unsupported:
                await asyncio.gather(*(self._alone(q) for q in take))
                return
            try:
                # The call's own id is not one meta keeps (each item has
                # its own): it is not held against the spread, so a batch
                # never waits on its own items.
                reply = await self._call("Batch", pb.BatchRequest(items=[q.item() for q in take]), pb.BatchReply,
                                         mutating=True, request_id=self._untracked_rid())
            except UnsupportedError:
                self._batch_unsupported = True  # a leader without Batch: one call each
                await asyncio.gather(*(self._alone(q) for q in take))
                return
            except TierFSError as err:
                for q in take:
                    q.fail(err)
                return
            if len(reply.results) != len(take):
                bad = InternalError(f"Batch: {len(reply.results)} results for {len(take)} items")
                for q in take:
                    q.fail(bad)
                return
            self.batch_calls += 1
            self.batched_ops += len(take)
            again: list[_Queued] = []
            for q, res in zip(take, reply.results, strict=True):
                if res.error.code:
                    item_err = error_from_code(res.error.code, res.error.message, leader=res.error.leader)
                    if isinstance(item_err, _RETRY_ALONE):
                        again.append(q)
                    else:
                        q.fail(item_err)
                    continue
                try:
                    out = q.reply_cls.FromString(res.reply)
                except Exception as exc:  # a reply that does not parse is the server's bug
                    q.fail(InternalError(f"Batch: bad reply for {q.method}: {exc!r}"))
                    continue
                if self.capability_sink is not None:
                    _harvest(out, self.capability_sink)
                q.done(out)
            if again:
                await asyncio.gather(*(self._alone(q) for q in again))
        except BaseException as exc:
            for q in take:
                q.fail(exc if isinstance(exc, Exception) else UnavailableError("MetaClient is closed"))
            raise
        finally:
            self._mut_busy -= 1
            self._schedule_batch()

    async def _alone(self, q: _Queued) -> None:
        """One queued mutation in a call of its own (same request id)."""
        try:
            q.done(await self._call(q.method, q.req, q.reply_cls, mutating=True, request_id=q.rid))
        except TierFSError as err:
            q.fail(err)

    def _is_unreachable(self, addr: str) -> bool:
        until = self._unreachable.get(addr)
        if until is None:
            return False
        if asyncio.get_running_loop().time() >= until:
            del self._unreachable[addr]
            return False
        return True

    def _prefer_leader(self, target: str, trailing: Any) -> None:
        """A follower that forwarded the call names the leader: go there
        directly next time, unless it did not answer us lately (then the
        follower that forwards is the way in)."""
        for item in trailing or ():
            if item[0] == LEADER_KEY:
                leader = item[1] if isinstance(item[1], str) else bytes(item[1]).decode()
                if leader and leader != target and not self._is_unreachable(leader):
                    if leader not in self.addrs:
                        self.addrs.append(leader)
                    self._leader = leader
                return

    def _next(self, addr: str) -> str:
        """The replica after ``addr``, skipping those that did not answer
        lately (unless all of them did not)."""
        i = self.addrs.index(addr) if addr in self.addrs else -1
        order = [self.addrs[(i + k) % len(self.addrs)] for k in range(1, len(self.addrs) + 1)]
        return next((a for a in order if not self._is_unreachable(a)), order[0])

    # ---- namespace --------------------------------------------------------------

    async def mkdir(self, where: str | tuple[int, str], mode: int = 0o755, uid: int = 0, gid: int = 0) -> pb.FileInfo:
        return await self._mutate("Mkdir", pb.MkdirRequest(loc=_loc(where), mode=mode, uid=uid, gid=gid),
                                  pb.FileInfo)

    async def create(self, where: str | tuple[int, str], mode: int = 0o644, uid: int = 0, gid: int = 0, *,
                     layout: pb.Layout | None = None, chunk_size: int = 0, redundancy: str = "",
                     stripe_width: int = 0, map_version: int = 0) -> pb.FileInfo:
        """Create an empty regular file (AlreadyExistsError if the name is
        taken). Layout fields left unset are inherited from the directory."""
        req = pb.CreateRequest(loc=_loc(where), mode=mode, uid=uid, gid=gid, map_version=map_version)
        lay = _layout(layout, chunk_size, redundancy, stripe_width)
        if lay is not None:
            req.layout.CopyFrom(lay)
            req.has_layout = True
        return await self._call("Create", req, pb.FileInfo, mutating=True)

    async def lookup(self, parent: int, name: str) -> pb.FileInfo:
        return await self._call("Lookup", pb.LookupRequest(parent=parent, name=name), pb.FileInfo)

    async def stat(self, where: Where) -> pb.FileInfo:
        return await self._call("Stat", pb.StatRequest(loc=_loc(where)), pb.FileInfo)

    async def readdir(self, where: Where, cursor: str = "", limit: int = 0) -> pb.ReaddirReply:
        """One page of entries sorted by name; pass ``reply.next_cursor`` on."""
        return await self._call("Readdir", pb.ReaddirRequest(loc=_loc(where), cursor=cursor, limit=limit),
                                pb.ReaddirReply)

    async def iterdir(self, where: Where, page: int = 1000) -> AsyncIterator[pb.DirEntry]:
        """Every entry of a directory, fetched a page at a time."""
        cursor = ""
        while True:
            reply = await self.readdir(where, cursor, page)
            for e in reply.entries:
                yield e
            if not reply.next_cursor:
                return
            cursor = reply.next_cursor

    async def rename(self, src: str | tuple[int, str], dst: str | tuple[int, str]) -> None:
        await self._mutate("Rename", pb.RenameRequest(src=_loc(src), dst=_loc(dst)), pb.Empty)

    async def unlink(self, where: str | tuple[int, str], *, expect_inode: int = 0,
                     only_if_empty: bool = False) -> None:
        """Remove a name. ``expect_inode``: only if it still names that
        inode; ``only_if_empty``: only an empty regular file without a live
        writer (BusyError otherwise, and nothing changes)."""
        await self._mutate("Unlink", pb.UnlinkRequest(loc=_loc(where), expect_inode=expect_inode,
                                                      only_if_empty=only_if_empty), pb.Empty)

    async def rmdir(self, where: str | tuple[int, str]) -> None:
        await self._mutate("Rmdir", pb.RmdirRequest(loc=_loc(where)), pb.Empty)

    async def symlink(self, where: str | tuple[int, str], target: str, uid: int = 0, gid: int = 0) -> pb.FileInfo:
        return await self._mutate("Symlink", pb.SymlinkRequest(loc=_loc(where), target=target, uid=uid, gid=gid),
                                  pb.FileInfo)

    async def readlink(self, where: Where) -> str:
        return (await self._call("Readlink", pb.ReadlinkRequest(loc=_loc(where)), pb.ReadlinkReply)).target

    async def setattr(self, where: Where, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, mtime_ns: int | None = None) -> pb.FileInfo:
        req = pb.SetAttrRequest(loc=_loc(where))
        if mode is not None:
            req.set_mode, req.mode = True, mode
        if uid is not None:
            req.set_uid, req.uid = True, uid
        if gid is not None:
            req.set_gid, req.gid = True, gid
        if mtime_ns is not None:
            req.set_mtime, req.mtime_ns = True, mtime_ns
        return await self._call("SetAttr", req, pb.FileInfo, mutating=True)

    async def truncate(self, where: Where, size: int) -> pb.FileInfo:
        return await self._call("Truncate", pb.TruncateRequest(loc=_loc(where), size=size), pb.FileInfo,
                                mutating=True)

    async def set_layout(self, where: Where, layout: pb.Layout | None = None, *, chunk_size: int = 0,
                         redundancy: str = "", stripe_width: int = 0) -> pb.Layout:
        """Set a directory's layout policy (unset fields inherit); returns
        the directory's effective layout."""
        lay = _layout(layout, chunk_size, redundancy, stripe_width) or pb.Layout()
        reply = await self._call("SetLayout", pb.SetLayoutRequest(loc=_loc(where), layout=lay), pb.LayoutReply,
                                 mutating=True)
        return reply.layout

    async def get_layout(self, where: Where) -> pb.Layout:
        return (await self._call("GetLayout", pb.GetLayoutRequest(loc=_loc(where)), pb.LayoutReply)).layout

    # ---- write sessions ---------------------------------------------------------

    async def open_write(self, where: Where, *, owner: str = "", lease_ms: int = 0,
                         map_version: int = 0) -> pb.OpenWriteReply:
        return await self._call("OpenWrite", pb.OpenWriteRequest(loc=_loc(where), owner=owner, lease_ms=lease_ms,
                                                                 map_version=map_version),
                                pb.OpenWriteReply, mutating=True)

    async def renew_lease(self, session_id: int, uploads: Iterable[tuple[int, int]] = (), lease_ms: int = 0,
                          chunks: Iterable[pb.ChunkRecord] = (), *, deadline: float | None = None) -> int:
        """Extend the lease, telling meta of the uploads (chunk, generation)
        begun and staging the records of the chunks stored since the last
        renewal; returns the new expiry (ns since the epoch). ``deadline``:
        a shorter bound than the client's on this call's retries."""
        req = pb.RenewLeaseRequest(session_id=session_id, lease_ms=lease_ms, chunks=list(chunks),
                                   uploads=[pb.ChunkUpload(index=c, generation=g) for c, g in uploads])
        reply = await self._call("RenewLease", req, pb.RenewLeaseReply, mutating=True, deadline=deadline)
        return reply.lease_expiry_ns

    async def commit_write(self, session_id: int, size: int, chunks: Iterable[pb.ChunkRecord],
                           uploads: Iterable[tuple[int, int]] = (), map_version: int = 0) -> pb.FileInfo:
        """Publish the session's chunks (one record each: generation, length,
        CRC32C, fragments not stored) and the new size; ``uploads``: those
        (chunk, generation) not reported by a renewal yet; ``map_version``:
        the oldest cluster map the fragments were placed with (0: unknown)."""
        req = pb.CommitWriteRequest(session_id=session_id, size=size, chunks=list(chunks),
                                    uploads=[pb.ChunkUpload(index=c, generation=g) for c, g in uploads],
                                    map_version=map_version)
        return await self._call("CommitWrite", req, pb.FileInfo, mutating=True)

    async def abort_write(self, session_id: int, uploads: Iterable[tuple[int, int]] = (), *,
                          deadline: float | None = None) -> None:
        """End the session, its uploads to GC. ``deadline``: a shorter bound
        than the client's on this call's retries."""
        req = pb.AbortWriteRequest(session_id=session_id,
                                   uploads=[pb.ChunkUpload(index=c, generation=g) for c, g in uploads])
        await self._call("AbortWrite", req, pb.Empty, mutating=True, deadline=deadline)

    # ---- cluster map --------------------------------------------------------------

    async def register_node(self, node_uuid: str, hostname: str, data_addr: str,
                            targets: Sequence[tuple[str, int]] | Sequence[pb.TargetSpec],
                            control_addr: str = "", rack: str = "") -> pb.RegisterNodeReply:
        specs = [t if isinstance(t, pb.TargetSpec) else pb.TargetSpec(path=t[0], capacity=t[1]) for t in targets]
        req = pb.RegisterNodeRequest(node_uuid=node_uuid, hostname=hostname, data_addr=data_addr,
                                     control_addr=control_addr, targets=specs, rack=rack)
        return await self._call("RegisterNode", req, pb.RegisterNodeReply, mutating=True)

    async def heartbeat(self, node_id: int, targets: Sequence[pb.TargetReport],
                        kv_usage: Sequence[pb.KVTargetUsage] = (), *, kv_map_version: int | None = None,
                        ) -> pb.HeartbeatReply:
        """``kv_map_version``: the map the node's KV checks use (it then
        takes KV map leases: docs/kv.md, "Map leases"); None: no leases."""
        req = pb.HeartbeatRequest(node_id=node_id, targets=list(targets), kv_usage=list(kv_usage),
                                  kv_map_version=max(0, kv_map_version or 0), kv_leases=kv_map_version is not None)
        return await self._call("Heartbeat", req, pb.HeartbeatReply, mutating=True)

    async def get_cluster_map(self, known_version: int = 0, *, wait: float = 0.0) -> pb.ClusterMap:
        """The cluster map (``unchanged`` when ``known_version`` is current);
        ``wait`` > 0: the leader holds the answer up to that long (at most
        5 s) until the map changes."""
        wait_ms = min(5000, int(wait * 1000))
        req = pb.GetClusterMapRequest(known_version=known_version, wait_ms=wait_ms)
        return await self._call("GetClusterMap", req, pb.ClusterMap,
                                attempt_timeout=(wait_ms / 1000 + self.attempt_timeout) if wait_ms else None)

    async def list_group_chunks(self, group_id: int, after_inode: int = 0, limit: int = 0, *,
                                gc_holder: int = 0, after_gc_id: int = 0) -> pb.ListGroupChunksReply:
        """Committed chunks stored in a placement group (for the repair
        worker); page with ``reply.next_inode`` (0 = last page).
        ``gc_holder``: instead, the group's generations waiting for GC that
        this member still holds; page with ``reply.next_gc_id`` (a meta older
        than stop 52 ignores ``gc_holder``: its chunks have ``gc_id`` 0)."""
        return await self._call("ListGroupChunks", pb.ListGroupChunksRequest(
            group_id=group_id, after_inode=after_inode, limit=limit, gc_holder=gc_holder,
            after_gc_id=after_gc_id), pb.ListGroupChunksReply)

    async def finish_rebuild(self, group_id: int, target_id: int) -> None:
        """Declare ``target_id`` rebuilt in ``group_id`` (clears it from the
        group's ``rebuilding`` list)."""
        await self._call("FinishRebuild", pb.FinishRebuildRequest(group_id=group_id, target_id=target_id),
                         pb.Empty, mutating=True)

    async def remove_target(self, target_id: int, *, force: bool = False) -> pb.ReplaceReply:
        """Declare a target dead: replaced in every group at once, never used
        again. Refused (``BusyError``) while it is online and the last readable
        copy of some group, unless ``force``."""
        return await self._call("RemoveTarget", pb.RemoveTargetRequest(target_id=target_id, force=force),
                                pb.ReplaceReply, mutating=True)

    async def drain_node(self, node_id: int) -> pb.ReplaceReply:
        """Move every fragment off a healthy node (its targets leave every group)."""
        return await self._call("DrainNode", pb.DrainNodeRequest(node_id=node_id), pb.ReplaceReply, mutating=True)

    async def undrain_node(self, node_id: int) -> bool:
        """Undo a drain: the node may take new fragments again (groups
        already moved stay moved). Whether it was draining."""
        reply = await self._call("UndrainNode", pb.UndrainNodeRequest(node_id=node_id), pb.UndrainNodeReply,
                                 mutating=True)
        return bool(reply.was_draining)

    async def label_node(self, node_id: int, rack: str) -> None:
        """Set a node's failure domain ("" clears it); groups that then
        break the rack rule are moved by the rebalancer."""
        await self._call("LabelNode", pb.LabelNodeRequest(node_id=node_id, rack=rack), pb.Empty, mutating=True)

    async def rebalance_status(self) -> pb.RebalanceStatus:
        """The leader's rebalance progress (docs/rebalance.md)."""
        return await self._call("GetRebalanceStatus", pb.Empty(), pb.RebalanceStatus)

    async def remove_node(self, node_id: int) -> None:
        """Forget a node no group needs any more (BusyError otherwise)."""
        await self._call("RemoveNode", pb.RemoveNodeRequest(node_id=node_id), pb.Empty, mutating=True)

    # ---- KV pools -------------------------------------------------------------------

    async def create_kv_pool(self, name: str, *, redundancy: str = "replica:1", target_memory: int = 0,
                             target_disk: int = 0, fsync: bool = False, pin_quota: int = 0,
                             policy: str = "", tenant: str = "") -> pb.KVPool:
        """Define a KV pool (AlreadyExistsError if the name is taken,
        InvalidArgumentError for a bad name, redundancy or budget). The
        reply's ``groups`` is empty while fewer storage nodes than the
        pool's width have an online target."""
        req = pb.CreateKVPoolRequest(name=name, redundancy=redundancy, target_memory=target_memory,
                                     target_disk=target_disk, fsync=fsync, pin_quota=pin_quota, policy=policy,
                                     tenant=tenant)
        return await self._call("CreateKVPool", req, pb.KVPool, mutating=True)

    async def get_kv_capability(self, pool: str) -> pb.GetKVCapabilityReply:
        """A short-lived KV capability for this caller's tenant of ``pool``
        (empty when meta mints none: security off)."""
        return await self._call("GetKVCapability", pb.GetKVCapabilityRequest(pool=pool), pb.GetKVCapabilityReply)

    async def list_kv_pools(self) -> pb.ListKVPoolsReply:
        """Every KV pool, with the per-(pool, target) usage last reported to the leader."""
        return await self._call("ListKVPools", pb.Empty(), pb.ListKVPoolsReply)

    async def remove_kv_pool(self, name: str) -> None:
        """Forget a KV pool (NotFoundError if there is none of that name);
        storage daemons drop its objects when they see the new map."""
        await self._call("RemoveKVPool", pb.RemoveKVPoolRequest(name=name), pb.Empty, mutating=True)

    # ---- garbage collection ---------------------------------------------------------

    async def list_gc(self, target_ids: Iterable[int], after_id: int = 0, limit: int = 0) -> list[pb.GCItem]:
        reply = await self._call("ListGC", pb.ListGCRequest(target_ids=list(target_ids), after_id=after_id,
                                                            limit=limit), pb.ListGCReply)
        return list(reply.items)

    async def list_repairs(self, target_ids: Iterable[int], limit: int = 0) -> pb.ListRepairsReply:
        """Fragments known missing or bad that ``target_ids`` must rebuild."""
        return await self._call("ListRepairs", pb.ListRepairsRequest(target_ids=list(target_ids), limit=limit),
                                pb.ListRepairsReply)

    async def mark_fragments(self, items: Iterable[pb.RepairItem], *, done: bool) -> int:
        """Report fragments rebuilt (``done``) or found missing or bad."""
        req = pb.MarkFragmentsRequest(items=list(items), done=done)
        return (await self._call("MarkFragments", req, pb.MarkFragmentsReply, mutating=True)).changed

    async def list_gc_and_purges(self, target_ids: Iterable[int], limit: int = 0,
                                 ) -> tuple[list[pb.GCItem], list[pb.GroupPurge]]:
        """The first page of :meth:`list_gc`, and the group purges ready for
        ``target_ids``: copies of positions these targets no longer hold, to
        delete (none from a meta older than stop 54). One call, one read
        barrier."""
        reply = await self._call("ListGC", pb.ListGCRequest(target_ids=list(target_ids), limit=limit, purges=True),
                                 pb.ListGCReply)
        return list(reply.items), list(reply.purges)

    async def ack_purges(self, purged: Iterable[pb.GroupPurge]) -> int:
        """Acknowledge group purges done; how many meta still had."""
        req = pb.AckGCRequest(purged=list(purged))
        return (await self._call("AckGC", req, pb.AckGCReply, mutating=True)).purges_acked

    async def ack_gc(self, acks: Iterable[tuple[int, int]]) -> int:
        """Acknowledge deleted fragments: ``(gc item id, target id)`` pairs."""
        req = pb.AckGCRequest(acks=[pb.GCAck(id=i, target_id=t) for i, t in acks])
        return (await self._call("AckGC", req, pb.AckGCReply, mutating=True)).acked

    # ---- replicas -------------------------------------------------------------------

    async def status(self, addr: str | None = None) -> pb.GetStatusReply:
        """The status of ``addr`` (or of whichever replica answers)."""
        return await self._call("GetStatus", pb.Empty(), pb.GetStatusReply, addr=addr)

    async def digest(self, addr: str | None = None) -> pb.DigestReply:
        return await self._call("Digest", pb.Empty(), pb.DigestReply, addr=addr)

    async def force_snapshot(self, addr: str | None = None) -> None:
        """Ask ``addr`` (or whichever replica answers) to snapshot and compact
        its journal on its next Raft tick; ``status().raft.snapshots`` counts them."""
        await self._call("ForceSnapshot", pb.Empty(), pb.Empty, addr=addr)

    # Membership changes are not deduplicated by the state machine, so one
    # attempt may use the whole deadline rather than be cut short and resent.

    async def add_member(self, raft_addr: str, grpc_addr: str) -> None:
        await self._call("AddMetaMember", pb.MetaMemberRequest(raft_addr=raft_addr, grpc_addr=grpc_addr),
                         pb.Empty, mutating=True, attempt_timeout=self.deadline)

    async def remove_member(self, raft_addr: str, grpc_addr: str) -> None:
        await self._call("RemoveMetaMember", pb.MetaMemberRequest(raft_addr=raft_addr, grpc_addr=grpc_addr),
                         pb.Empty, mutating=True, attempt_timeout=self.deadline)

    # ---- users and tokens (admin only) -----------------------------------------

    async def add_user(self, name: str, uid: int, gid: int, groups: Iterable[int] = (), *, admin: bool = False,
                       expires: float = 0.0) -> pb.UserTokenReply:
        """Add a user with a first token (``expires``: seconds it lasts, 0 =
        never); the reply holds the token in clear, this once."""
        req = pb.AddUserRequest(name=name, uid=uid, gid=gid, groups=list(groups), admin=admin,
                                expires_ms=_lifetime_ms(expires))
        return await self._call("AddUser", req, pb.UserTokenReply, mutating=True)

    async def list_users(self) -> list[pb.User]:
        return list((await self._call("ListUsers", pb.Empty(), pb.ListUsersReply)).users)

    async def remove_user(self, name: str) -> None:
        """Forget a user: every token of it stops working at once."""
        await self._call("RemoveUser", pb.RemoveUserRequest(name=name), pb.Empty, mutating=True)

    async def issue_token(self, name: str, *, expires: float = 0.0) -> pb.UserTokenReply:
        """Another token for ``name`` (shown in the reply, this once)."""
        return await self._call("IssueToken", pb.IssueTokenRequest(name=name, expires_ms=_lifetime_ms(expires)),
                                pb.UserTokenReply, mutating=True)

    async def revoke_token(self, name: str, token_id: int = 0, *, all: bool = False) -> int:
        """Revoke one token of ``name`` (or ``all``); returns how many."""
        req = pb.RevokeTokenRequest(name=name, token_id=token_id, all=all)
        return (await self._call("RevokeToken", req, pb.RevokeTokenReply, mutating=True)).revoked

    async def whoami(self, token: str | None = None) -> pb.Caller:
        """Who meta takes this client (or ``token``) for."""
        return await self._call("WhoAmI", pb.Empty(), pb.Caller, token=token)
