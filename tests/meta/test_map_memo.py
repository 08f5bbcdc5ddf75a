"""GetClusterMap for callers that hold a map (storage daemons' map
watches, clients' refreshes: ``known_version`` set) builds a whole map at
most once per map version and MAP_MEMO_S (tierfs.meta.service
MetaServicer.cluster_map): a map change sent every daemon's watch there at
once, each build O(nodes + targets + groups), 9 ms at 1,000 targets."""

from __future__ import annotations

import pytest

from tests.meta.meta_helpers import meta_server, register_async, run
from tierfs.proto.v1 import meta_pb2 as pb


@pytest.mark.timeout(60)
def test_a_map_version_is_built_once_for_callers_that_hold_a_map(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierfs.meta.service as service

    monkeypatch.setattr(service, "MAP_MEMO_S", 600.0)  # a slow machine must not expire it mid-test

    async def go() -> None:
        async with meta_server() as (mc, svc, _addr):
            regs = await register_async(mc, nodes=4, targets=1)
            builds = [0]
            real = type(svc.state).cluster_map

            def counted(sm: object, known_version: int = 0) -> pb.ClusterMap:
                builds[0] += 1
                return real(sm, known_version)  # type: ignore[arg-type]

            monkeypatch.setattr(type(svc.state), "cluster_map", counted)
            v = (await mc.get_cluster_map()).version
            assert builds[0] == 1
            maps = [await mc.get_cluster_map(known_version=v - 1) for _ in range(20)]
            assert builds[0] == 2  # once for the 20 watchers
            assert all(m.version == v and len(m.targets) == 4 and not m.unchanged for m in maps)
            assert (await mc.get_cluster_map(known_version=v)).unchanged
            # A change: built again, once, and it shows the change.
            tid = regs[0].targets[0].target_id
            await mc.heartbeat(regs[0].node_id, [pb.TargetReport(target_id=tid, state=pb.TARGET_STATE_READ_ONLY)])
            maps = [await mc.get_cluster_map(known_version=v) for _ in range(5)]
            assert builds[0] == 3
            assert all(m.version > v for m in maps)
            assert {t.target_id: t.state for t in maps[0].targets}[tid] == pb.TARGET_STATE_READ_ONLY
            # Callers without a map (the CLI) get a fresh one every time.
            await mc.get_cluster_map()
            await mc.get_cluster_map()
            assert builds[0] == 5

    run(go())
