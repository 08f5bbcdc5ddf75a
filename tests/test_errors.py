"""The exception tree: codes, builtin mix-ins, and the gRPC round trip."""

import asyncio
import pickle

import grpc
import pytest

from tierfs import errors as E
from tierfs.proto.v1 import common_pb2


def test_every_error_code_has_a_class() -> None:
    for name, num in common_pb2.ErrorCode.items():
        if num == 0:
            continue
        err = E.error_from_code(num, "m")
        assert err.code == num, name
        assert isinstance(err, E.TierFSError)


def test_builtin_mixins() -> None:
    assert isinstance(E.NotFoundError("x"), FileNotFoundError)
    assert isinstance(E.AlreadyExistsError("x"), FileExistsError)
    assert isinstance(E.ConfigError("bad", field="f"), ValueError)
    assert E.NotFoundError("no such file: /a").errno == 2
    assert str(E.NotFoundError("no such file: /a")) == "no such file: /a"


def test_unknown_code_is_internal() -> None:
    err = E.error_from_code(9999, "boom")
    assert isinstance(err, E.InternalError)
    assert "9999" in str(err)


def test_pickle_keeps_details() -> None:
    err = pickle.loads(pickle.dumps(E.NotLeaderError(leader="127.0.0.1:7001")))
    assert isinstance(err, E.NotLeaderError) and err.leader == "127.0.0.1:7001"


class _Svc:
    @E.grpc_errors
    async def ok(self, request: bytes, context: object) -> bytes:
        return request

    @E.grpc_errors
    async def fail(self, request: bytes, context: object) -> bytes:
        if request == b"leader":
            raise E.NotLeaderError(leader="10.0.0.1:7000")
        if request == b"bug":
            raise RuntimeError("oops")
        raise E.NotFoundError("no such file: /x")


@pytest.mark.timeout(30)
def test_grpc_round_trip() -> None:
    async def main() -> None:
        svc = _Svc()
        ident = lambda b: b  # noqa: E731
        handler = grpc.method_handlers_generic_handler(
            "t.S",
            {
                "Ok": grpc.unary_unary_rpc_method_handler(svc.ok, ident, ident),
                "Fail": grpc.unary_unary_rpc_method_handler(svc.fail, ident, ident),
            },
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                ok = ch.unary_unary("/t.S/Ok")
                fail = ch.unary_unary("/t.S/Fail")
                assert await ok(b"hi") == b"hi"
                for req, cls in ((b"nf", E.NotFoundError), (b"leader", E.NotLeaderError),
                                 (b"bug", E.InternalError)):
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await fail(req)
                    err = E.from_grpc(ei.value)
                    assert type(err) is cls, (req, err)
                    if cls is E.NotLeaderError:
                        assert err.leader == "10.0.0.1:7000"  # type: ignore[attr-defined]
                    if cls is E.InternalError:
                        assert "oops" in str(err)
        finally:
            await server.stop(None)

    asyncio.run(main())
