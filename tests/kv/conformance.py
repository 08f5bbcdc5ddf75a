"""The conformance suite every KV tier passes (DRAM, SSD, cluster, GPU).

A subclass provides one fixture, ``make_tier``: a factory
``make_tier(capacity_bytes) -> Tier`` building a fresh, empty tier of about
that capacity (a tier may round it). The tier is built outside any event
loop; each test drives it inside one ``asyncio.run`` and the base class
closes every tier it made. ``DemotingTierConformance`` adds the check of
``on_evict`` (the hook a TierStack demotes through) for tiers that call it;
a bottom tier (the cluster) need not.

``exact_counts`` (class attribute, True by default): the tier's ``objects``
and ``used`` are exact after each operation. A tier whose figures live
elsewhere and reach it late (the cluster: the daemons own them and report
them through meta) sets it False; the tests then still check every other
count exactly, and that ``objects`` / ``used`` / ``evictions`` are
plausible (never negative, ``used`` within ``capacity``), instead of
asserting values such a tier cannot know. No test is skipped for it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import numpy as np
import pytest

from tierfs.errors import InvalidArgumentError
from tierfs.kv.tiers import MAX_KEY_BYTES, EvictCallback, Tier, TierStats

TierFactory = Callable[[int], Tier]

SIZES = [1, 4096 - 1, 64 << 10, 1 << 20, (4 << 20) + 3]
MiB = 1 << 20


def pattern(key: bytes, size: int) -> bytes:
    """Deterministic bytes for ``key``: a wrong object or a wrong offset shows."""
    seed = int.from_bytes(key[-8:].rjust(8, b"\0"), "little") ^ size
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def before(deadline: float) -> bool:
    """Still before ``deadline`` now, so an operation that has just returned
    ran before it: asserting that an object with that expiry was there is
    sound. (Under a heavy load a test could otherwise race its own TTL.)"""
    return time.monotonic() < deadline


class TierConformance:
    """Subclass and provide ``make_tier`` (see the module docstring)."""

    capacity = 32 * MiB  # of the default ``tier``
    exact_counts = True  # see the module docstring

    def check_counts(self, st: TierStats, objects: int, used: int | None = None) -> None:
        """``objects`` (and ``used``, if given) as the tier must report them:
        exactly, or plausibly for a tier without exact counts."""
        if self.exact_counts:
            assert st.objects == objects
            if used is not None:
                assert st.used == used
        else:
            assert st.objects >= 0 and 0 <= st.used <= st.capacity and st.evictions >= 0

    @pytest.fixture
    def new_tier(self, make_tier: TierFactory) -> Iterator[TierFactory]:
        made: list[Tier] = []

        def new(capacity_bytes: int) -> Tier:
            t = make_tier(capacity_bytes)
            made.append(t)
            return t

        yield new

        async def close_all() -> None:
            for t in made:
                await t.close()

        run(close_all())

    @pytest.fixture
    def tier(self, new_tier: TierFactory) -> Tier:
        return new_tier(self.capacity)

    # -- round trips -------------------------------------------------------------

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("size", SIZES, ids=[str(s) for s in SIZES])
    def test_roundtrip(self, tier: Tier, size: int) -> None:
        async def main() -> None:
            key = f"obj-{size}".encode()
            data = pattern(key, size)
            assert await tier.put(key, memoryview(data)) is True
            assert await tier.size_of(key) == size
            exact = bytearray(size)
            assert await tier.get_into(key, memoryview(exact)) == size
            assert exact == data
            # a larger destination: the bytes past the object stay as they were
            big = bytearray(b"\xee" * (size + 4099))
            assert await tier.get_into(key, memoryview(big)) == size
            assert big[:size] == data and big[size:] == b"\xee" * 4099
            # and into a buffer at an odd offset
            odd = bytearray(size + 1)
            assert await tier.get_into(key, memoryview(odd)[1:]) == size
            assert odd[1:] == data

        run(main())

    @pytest.mark.timeout(30)
    def test_many_objects_each_its_own_bytes(self, tier: Tier) -> None:
        async def main() -> None:
            sizes = [1, 100, 4096, 4097, 12345, 65536, 65537, 200_000]
            keys = [f"m{i}".encode() for i in range(len(sizes) * 3)]
            for i, k in enumerate(keys):
                assert await tier.put(k, memoryview(pattern(k, sizes[i % len(sizes)])))
            for i, k in enumerate(keys):
                size = sizes[i % len(sizes)]
                out = bytearray(size)
                assert await tier.get_into(k, memoryview(out)) == size
                assert out == pattern(k, size), k

        run(main())

    # -- misses, duplicates, deletes ---------------------------------------------------

    @pytest.mark.timeout(30)
    def test_miss(self, tier: Tier) -> None:
        async def main() -> None:
            before = tier.stats().misses
            dest = bytearray(b"\x11" * 100)
            assert await tier.get_into(b"absent", memoryview(dest)) is None
            assert dest == b"\x11" * 100
            assert await tier.size_of(b"absent") is None
            assert tier.stats().misses == before + 1

        run(main())

    @pytest.mark.timeout(30)
    def test_put_existing_is_false_and_keeps_content(self, tier: Tier) -> None:
        async def main() -> None:
            assert await tier.put(b"dup", memoryview(b"first value"))
            assert await tier.put(b"dup", memoryview(b"second, longer value")) is False
            out = bytearray(64)
            assert await tier.get_into(b"dup", memoryview(out)) == len(b"first value")
            assert out[:11] == b"first value"
            self.check_counts(tier.stats(), 1)

        run(main())

    @pytest.mark.timeout(30)
    def test_delete(self, tier: Tier) -> None:
        async def main() -> None:
            await tier.put(b"gone", memoryview(b"x" * 5000))
            await tier.put(b"kept", memoryview(b"y" * 5000))
            assert await tier.delete(b"gone") is True
            assert await tier.delete(b"gone") is False
            assert await tier.get_into(b"gone", memoryview(bytearray(5000))) is None
            assert await tier.contains([b"gone", b"kept"]) == [False, True]
            self.check_counts(tier.stats(), 1, 5000)
            # the key can be stored again, with new content
            assert await tier.put(b"gone", memoryview(b"z" * 10))
            out = bytearray(10)
            assert await tier.get_into(b"gone", memoryview(out)) == 10 and out == b"z" * 10

        run(main())

    @pytest.mark.timeout(30)
    def test_contains(self, tier: Tier) -> None:
        async def main() -> None:
            keys = [f"c{i}".encode() for i in range(10)]
            for k in keys[::2]:
                await tier.put(k, memoryview(k))
            assert await tier.contains(keys) == [i % 2 == 0 for i in range(10)]
            assert await tier.contains([]) == []

        run(main())

    # -- capacity ------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_overflow_evicts_and_never_fails(self, new_tier: TierFactory) -> None:
        cap = 2 * MiB
        t = new_tier(cap)
        size = 64 << 10
        n = 3 * cap // size  # three times the capacity

        async def main() -> None:
            keys = [f"ov{i}".encode() for i in range(n)]
            for k in keys:
                assert await t.put(k, memoryview(pattern(k, size))) is True
                st = t.stats()
                assert st.used <= st.capacity
            st = t.stats()
            if self.exact_counts:
                assert st.evictions >= n - cap // size
                assert st.objects + st.evictions == n
            else:
                self.check_counts(st, 0)
            assert st.puts >= n
            # the most recent objects are the ones kept, with their own bytes
            recent = keys[-(cap // size) // 2 :]
            assert all(await t.contains(recent))
            out = bytearray(size)
            for k in keys:
                got = await t.get_into(k, memoryview(out))
                assert got is None or (got == size and out == pattern(k, size)), k

        run(main())

    @pytest.mark.timeout(30)
    def test_object_larger_than_capacity_is_not_stored(self, new_tier: TierFactory) -> None:
        t = new_tier(1 * MiB)

        async def main() -> None:
            await t.put(b"small", memoryview(b"s" * 1000))
            assert await t.put(b"huge", memoryview(bytes(2 * MiB))) is False
            assert await t.contains([b"huge", b"small"]) == [False, True]

        run(main())

    # -- bad input -----------------------------------------------------------------------

    @pytest.mark.timeout(30)
    def test_small_dest_raises_and_writes_nothing(self, tier: Tier) -> None:
        async def main() -> None:
            await tier.put(b"big", memoryview(pattern(b"big", 70_000)))
            dest = bytearray(b"\x5a" * 69_999)
            with pytest.raises(InvalidArgumentError, match="smaller"):
                await tier.get_into(b"big", memoryview(dest))
            assert dest == b"\x5a" * 69_999
            arr = np.full(1000, 7, dtype=np.uint8)
            with pytest.raises(InvalidArgumentError):
                await tier.get_into(b"big", arr)
            assert (arr == 7).all()

        run(main())

    @pytest.mark.timeout(30)
    def test_readonly_and_noncontiguous_dest(self, tier: Tier) -> None:
        async def main() -> None:
            await tier.put(b"k", memoryview(b"abcdef" * 100))
            for key in (b"k", b"missing"):
                with pytest.raises(InvalidArgumentError, match="read-only"):
                    await tier.get_into(key, memoryview(bytes(1000)))  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError, match="read-only"):
                    await tier.get_into(key, memoryview(bytearray(1000)).toreadonly())
                strided = bytearray(b"\x01" * 2000)
                with pytest.raises(InvalidArgumentError, match="contiguous"):
                    await tier.get_into(key, memoryview(strided)[::2])
                assert strided == b"\x01" * 2000
                arr = np.zeros((40, 40), dtype=np.uint8)
                with pytest.raises(InvalidArgumentError, match="contiguous"):
                    await tier.get_into(key, arr[:, ::2])  # type: ignore[arg-type]
                assert not arr.any()
                with pytest.raises(InvalidArgumentError, match="buffer protocol"):
                    await tier.get_into(key, 12345)  # type: ignore[arg-type]

        run(main())

    @pytest.mark.timeout(30)
    def test_bad_values(self, tier: Tier) -> None:
        async def main() -> None:
            with pytest.raises(InvalidArgumentError, match="buffer protocol"):
                await tier.put(b"k", "a str")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError, match="contiguous"):
                await tier.put(b"k", memoryview(bytearray(100))[::2])
            assert await tier.contains([b"k"]) == [False]
            self.check_counts(tier.stats(), 0)

        run(main())

    @pytest.mark.timeout(30)
    def test_bad_keys(self, tier: Tier) -> None:
        async def main() -> None:
            dest = memoryview(bytearray(10))
            for bad in (b"", b"x" * (MAX_KEY_BYTES + 1), 42, None, bytearray(b"k")):
                with pytest.raises(InvalidArgumentError):
                    await tier.put(bad, memoryview(b"v"))  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError):
                    await tier.get_into(bad, dest)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError):
                    await tier.size_of(bad)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError):
                    await tier.delete(bad)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgumentError):
                    await tier.contains([b"ok", bad])  # type: ignore[list-item]
            self.check_counts(tier.stats(), 0)
            longest = b"L" * MAX_KEY_BYTES
            assert await tier.put(longest, memoryview(b"v"))
            # a str key is its UTF-8 bytes
            assert await tier.put("clé", memoryview(b"w"))  # type: ignore[arg-type]
            assert await tier.contains(["clé".encode(), longest]) == [True, True]
            assert await tier.get_into("clé", dest) == 1  # type: ignore[arg-type]

        run(main())

    # -- buffer kinds -----------------------------------------------------------------------

    @pytest.mark.timeout(30)
    def test_numpy_buffers(self, tier: Tier) -> None:
        async def main() -> None:
            src = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
            assert await tier.put(b"np", src)  # type: ignore[arg-type]
            assert await tier.size_of(b"np") == src.nbytes
            same = np.empty_like(src)
            assert await tier.get_into(b"np", same) == src.nbytes  # type: ignore[arg-type]
            assert np.array_equal(same, src)
            raw = np.zeros(src.nbytes + 10, dtype=np.uint8)
            assert await tier.get_into(b"np", raw) == src.nbytes  # type: ignore[arg-type]
            assert raw[: src.nbytes].tobytes() == src.tobytes() and not raw[src.nbytes :].any()
            # bytes and bytearray sources too
            assert await tier.put(b"b", b"plain bytes")  # type: ignore[arg-type]
            assert await tier.put(b"ba", bytearray(b"a bytearray"))  # type: ignore[arg-type]
            out = bytearray(11)
            assert await tier.get_into(b"ba", out) == 11 and out == b"a bytearray"  # type: ignore[arg-type]

        run(main())

    # -- concurrency ------------------------------------------------------------------------

    @pytest.mark.timeout(120)
    def test_concurrent_gets_and_puts_return_right_bytes(self, new_tier: TierFactory) -> None:
        t = new_tier(3 * MiB)  # small, so eviction runs under the readers
        rng = random.Random(7)
        sizes = [5000, 65536, 150_000, 300_001]
        keys = [f"cc{i}".encode() for i in range(60)]
        size_of = {k: sizes[i % len(sizes)] for i, k in enumerate(keys)}
        hits = 0

        async def worker(seed: int) -> None:
            nonlocal hits
            r = random.Random(seed)
            out = bytearray(max(sizes))
            for _ in range(40):
                k = r.choice(keys)
                if r.random() < 0.4:
                    await t.put(k, memoryview(pattern(k, size_of[k])))
                elif r.random() < 0.1:
                    await t.delete(k)
                else:
                    n = await t.get_into(k, memoryview(out))
                    if n is not None:
                        assert n == size_of[k]
                        assert out[:n] == pattern(k, n), k
                        hits += 1

        async def main() -> None:
            for k in keys[:20]:
                await t.put(k, memoryview(pattern(k, size_of[k])))
            await asyncio.gather(*(worker(rng.randrange(1 << 30)) for _ in range(16)))

        run(main())
        assert hits > 0
        st = t.stats()
        assert st.used <= st.capacity

    # -- stats -------------------------------------------------------------------------------

    @pytest.mark.timeout(30)
    def test_stats(self, tier: Tier) -> None:
        async def main() -> None:
            st0 = tier.stats()
            assert isinstance(st0, TierStats)
            assert st0.name == tier.name and st0.capacity > 0
            assert (st0.used, st0.objects, st0.hits, st0.puts) == (0, 0, 0, 0)
            await tier.put(b"s1", memoryview(b"a" * 1000))
            await tier.put(b"s2", memoryview(b"b" * 3000))
            out = bytearray(3000)
            await tier.get_into(b"s1", memoryview(out))
            await tier.get_into(b"s2", memoryview(out))
            await tier.get_into(b"s3", memoryview(out))
            st = tier.stats()
            assert st.puts == 2
            self.check_counts(st, 2, 4000)
            assert (st.hits - st0.hits, st.misses - st0.misses) == (2, 1)
            assert st.bytes_in - st0.bytes_in == 4000
            assert st.bytes_out - st0.bytes_out == 4000
            d = st.as_dict()
            for field in (
                "name", "capacity", "used", "objects", "hits", "misses", "evictions",
                "puts", "bytes_in", "bytes_out", "promotions", "demotions",
            ):  # fmt: skip
                assert field in d

        run(main())


    # -- expiry ------------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_an_object_is_gone_at_its_deadline(self, tier: Tier) -> None:
        async def main() -> None:
            short, keep, late = b"exp-short", b"exp-none", b"exp-late"
            deadline = time.monotonic() + 1.5
            t0 = time.monotonic()
            stored = await tier.put(short, memoryview(pattern(short, 5000)), expires=deadline)
            # the cluster's daemons start the TTL when the put reaches them:
            # their copy may outlive the deadline by at most the put's time
            hop = time.monotonic() - t0 + 0.01
            assert stored or not before(deadline)
            assert await tier.put(keep, memoryview(pattern(keep, 5000)))
            # already past: not stored, and nothing changes
            assert not await tier.put(late, memoryview(pattern(late, 5000)), expires=time.monotonic() - 1)
            present = await tier.contains([short, keep, late])
            assert present[1:] == [True, False] and (present[0] or not before(deadline))
            out = bytearray(5000)
            n = await tier.get_into(short, memoryview(out))
            if before(deadline):
                assert n == 5000 and out == pattern(short, 5000)
                # what a TierStack promotes it with, asked right after a hit
                assert 0 < tier.expiry_of(short) <= deadline + hop
            while time.monotonic() <= deadline + hop:
                await asyncio.sleep(0.05)
            assert await tier.get_into(short, memoryview(out)) is None
            assert await tier.contains([short, keep]) == [False, True]
            assert await tier.size_of(short) is None
            assert await tier.get_into(keep, memoryview(out)) == 5000 and out == pattern(keep, 5000)
            # the key is free again: a new value without expiry stays
            fresh = pattern(b"fresh", 5000)
            assert await tier.put(short, memoryview(fresh))
            assert await tier.get_into(short, memoryview(out)) == 5000 and out == fresh

        run(main())

    @pytest.mark.timeout(60)
    def test_a_live_object_with_an_expiry_is_served_until_then(self, tier: Tier) -> None:
        async def main() -> None:
            k = b"exp-long"
            deadline = time.monotonic() + 600
            assert await tier.put(k, memoryview(pattern(k, 70_000)), expires=deadline)
            assert not await tier.put(k, memoryview(pattern(b"other", 70_000)))  # held: a no-op
            out = bytearray(70_000)
            assert await tier.get_into(k, memoryview(out)) == 70_000 and out == pattern(k, 70_000)
            assert await tier.size_of(k) == 70_000
            assert await tier.delete(k)
            assert await tier.get_into(k, memoryview(out)) is None

        run(main())


class DemotingTierConformance(TierConformance):
    """TierConformance plus ``on_evict``: for tiers that demote their victims."""

    @staticmethod
    def demoting(new_tier: TierFactory, on_evict: EvictCallback) -> Tier:
        """A 1 MiB tier whose victims go to ``on_evict``."""
        t = new_tier(1 * MiB)
        t.on_evict = on_evict
        return t

    @pytest.mark.timeout(60)
    def test_on_evict_gets_the_victims_bytes(self, new_tier: TierFactory) -> None:
        size = 100_000
        seen: dict[bytes, bytes] = {}

        async def on_evict(key: bytes, view: memoryview, expires: float) -> None:
            await asyncio.sleep(0)  # a demotion takes time; the slot must stay put
            assert expires == 0.0
            seen[key] = bytes(view)

        t = self.demoting(new_tier, on_evict)

        async def main() -> None:
            keys = [f"ev{i}".encode() for i in range(40)]
            # puts four at a time: one's demotion is under way while the others
            # look for space, and must not be handed the victim's slot
            for i in range(0, len(keys), 4):
                got = await asyncio.gather(
                    *(t.put(k, memoryview(pattern(k, size))) for k in keys[i : i + 4])
                )
                assert all(got)
            assert seen, "nothing was evicted"
            for k, v in seen.items():
                assert v == pattern(k, size), k
            assert t.stats().evictions == len(seen)

        run(main())

    @pytest.mark.timeout(60)
    def test_victims_go_down_with_their_expiry_and_expired_ones_not_at_all(self, new_tier: TierFactory) -> None:
        size = 100_000
        seen: dict[bytes, float] = {}

        async def on_evict(key: bytes, view: memoryview, expires: float) -> None:
            seen[key] = expires

        t = self.demoting(new_tier, on_evict)

        async def main() -> None:
            soon = time.monotonic() + 1.0
            later = time.monotonic() + 600
            stored = await t.put(b"soon", memoryview(pattern(b"soon", size)), expires=soon)
            assert stored or not before(soon)
            assert await t.put(b"later", memoryview(pattern(b"later", size)), expires=later)
            while time.monotonic() <= soon:
                await asyncio.sleep(0.05)
            # fill the tier: "soon" has expired (its space comes back without
            # a demotion), "later" is evicted and handed down with its deadline
            for i in range(30):
                k = f"fill{i}".encode()
                assert await t.put(k, memoryview(pattern(k, size)))
            assert b"soon" not in seen
            assert seen.get(b"later") == later
            assert all(v == 0.0 for k, v in seen.items() if k.startswith(b"fill"))

        run(main())
