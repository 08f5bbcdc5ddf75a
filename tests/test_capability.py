"""tierfs.capability: format, signature, expiry, key epochs, scope checks."""

from __future__ import annotations

import pytest

from tierfs import capability as cap
from tierfs.errors import CapabilityExpiredError, PermissionDeniedError, UnauthenticatedError

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32
NOW = 1_700_000_000_000
ROT = 3600.0
EPOCH = cap.epoch_at(NOW, ROT)


def _ring(epoch: int = EPOCH) -> cap.Keyring:
    return cap.Keyring(cap.keys_around(SECRET, epoch))


def _file_cap(**kw: int) -> cap.Capability:
    args = dict(kind=cap.KIND_FILE, ops=cap.OP_READ, epoch=EPOCH, scope=42, principal=1000,
                expiry_ms=NOW + 60_000)
    args.update(kw)
    return cap.mint(cap.epoch_key(SECRET, args["epoch"]), **args)


def test_roundtrip_and_verify() -> None:
    c = _file_cap()
    raw = cap.encode(c)
    assert len(raw) == cap.CAP_SIZE == 64
    d = cap.decode(raw)
    assert d == c
    assert cap.verify(_ring(), NOW, raw) == c
    assert cap.check_scope(d, cap.KIND_FILE, 42, cap.OP_READ, 7) is None


# Every field of the body, flipped one bit at a time: the tag no longer
# verifies (or the body no longer parses). Offsets as in the module docstring.
@pytest.mark.parametrize("offset", [1, 2, 4, 8, 16, 24, 32, 40, 47, 48, 63])
def test_tamper_any_byte_is_refused(offset: int) -> None:
    raw = bytearray(cap.encode(_file_cap(ops=cap.OP_READ)))
    raw[offset] ^= 0x01 if offset not in (1, 2) else 0x03
    with pytest.raises(UnauthenticatedError):
        cap.verify(_ring(), NOW, bytes(raw))


def test_tamper_every_field_resigned_with_wrong_key() -> None:
    c = _file_cap()
    forged = cap.mint(b"x" * 32, kind=c.kind, ops=c.ops | cap.OP_WRITE, epoch=c.epoch, scope=c.scope,
                      principal=c.principal, expiry_ms=c.expiry_ms)
    with pytest.raises(UnauthenticatedError, match="does not verify"):
        cap.verify(_ring(), NOW, cap.encode(forged))
    for field, value in (("scope", 43), ("lo", 1), ("hi", 5), ("principal", 0), ("expiry_ms", NOW + 10**9),
                         ("ops", 3), ("kind", cap.KIND_NODE)):
        body = {f: getattr(c, f) for f in ("kind", "ops", "epoch", "scope", "lo", "hi", "principal", "expiry_ms")}
        body[field] = value
        moved = cap.Capability(**body, mac=c.mac)  # the old tag on a changed body
        with pytest.raises(UnauthenticatedError):
            cap.verify(_ring(), NOW, cap.encode(moved))


def test_expired_and_retired_epochs() -> None:
    with pytest.raises(CapabilityExpiredError, match="expired"):
        cap.verify(_ring(), NOW, cap.encode(_file_cap(expiry_ms=NOW)))
    old = _file_cap(epoch=EPOCH - 2)
    with pytest.raises(CapabilityExpiredError, match="retired"):
        cap.verify(_ring(), NOW, cap.encode(old))
    # e-1 and e+1 are held; e+2 is unknown (not yet handed out): unauthenticated
    for e in (EPOCH - 1, EPOCH + 1):
        cap.verify(_ring(), NOW, cap.encode(_file_cap(epoch=e)))
    with pytest.raises(UnauthenticatedError, match="unknown key epoch"):
        cap.verify(_ring(), NOW, cap.encode(_file_cap(epoch=EPOCH + 2)))
    # after rotation the old one goes
    with pytest.raises(CapabilityExpiredError):
        cap.verify(_ring(EPOCH + 1), NOW, cap.encode(_file_cap(epoch=EPOCH - 1)))


def test_malformed() -> None:
    with pytest.raises(UnauthenticatedError, match="64 bytes"):
        cap.decode(b"short")
    raw = bytearray(cap.encode(_file_cap()))
    raw[0] = 9
    with pytest.raises(UnauthenticatedError, match="malformed"):
        cap.decode(bytes(raw))
    with pytest.raises(ValueError):
        cap.mint(b"k" * 32, kind=7, ops=1, epoch=0, scope=0, principal=0, expiry_ms=0)


def test_scope_checks() -> None:
    r = _file_cap(ops=cap.OP_READ, lo=2, hi=4)
    assert cap.check_scope(r, cap.KIND_FILE, 42, cap.OP_READ, 3) is None
    for args, match in (((cap.KIND_FILE, 42, cap.OP_WRITE, 3), "does not allow write"),
                        ((cap.KIND_FILE, 41, cap.OP_READ, 3), "inode 41"),
                        ((cap.KIND_FILE, 42, cap.OP_READ, 4), "chunks"),
                        ((cap.KIND_KV, 42, cap.OP_READ, 0), "kv request")):
        err = cap.check_scope(r, *args)
        assert isinstance(err, PermissionDeniedError) and match in err.message, (args, err)
    kv = _file_cap(kind=cap.KIND_KV, ops=cap.OP_READ | cap.OP_WRITE, scope=5, principal=cap.tenant_of(7, 9, "group"))
    assert kv.principal == cap.GROUP_TENANT | 9
    assert cap.check_scope(kv, cap.KIND_KV, 5, cap.OP_WRITE) is None
    assert cap.check_scope(kv, cap.KIND_KV, 6, cap.OP_READ) is not None
    node = _file_cap(kind=cap.KIND_NODE, scope=3, principal=3)
    assert cap.check_scope(node, cap.KIND_FILE, 999, cap.OP_READ, 5) is None
    assert cap.check_scope(node, cap.KIND_FILE, 999, cap.OP_WRITE, 5) is not None
    assert cap.check_scope(node, cap.KIND_KV, 1, cap.OP_READ) is not None


def test_a_write_capability_names_its_session() -> None:
    from tierfs.chunk import generation

    key = b"k" * 32
    w = cap.mint(key, kind=cap.KIND_FILE, ops=cap.OP_WRITE, epoch=1, scope=9,
                    principal=cap.write_principal(1000, 5), expiry_ms=10**13)
    assert w.session == 5 and "write session version 5" in w.describe()
    assert cap.check_scope(w, cap.KIND_FILE, 9, cap.OP_WRITE, 0, generation(5, 7)) is None
    err = cap.check_scope(w, cap.KIND_FILE, 9, cap.OP_WRITE, 0, generation(4, 0))
    assert err is not None and "another write session" in str(err)
    # Versions wrap at 2**32; the one that wraps to 0 reads as 1 on both sides.
    wrap = cap.write_principal(1000, 1 << 32) >> cap.SESSION_SHIFT
    assert wrap == 1 == cap.session_of_generation(generation(1 << 32, 0))
    # One minted before stop 48 names none: any generation of its inode.
    old = cap.mint(key, kind=cap.KIND_FILE, ops=cap.OP_WRITE, epoch=1, scope=9, principal=1000,
                      expiry_ms=10**13)
    assert old.session == 0
    assert cap.check_scope(old, cap.KIND_FILE, 9, cap.OP_WRITE, 0, generation(4, 0)) is None
