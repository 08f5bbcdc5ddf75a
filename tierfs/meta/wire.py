"""Names the meta service and its clients share on the wire (gRPC metadata
keys, the ops a Batch call may carry). Kept apart from
:mod:`tierfs.meta.service` so that a client (CLI, storage daemon, engine
adapter) does not import the whole server to learn them."""

from __future__ import annotations

__all__ = ["BATCH_RPCS", "CLIENT_ID_KEY", "FORWARDED_KEY", "LEADER_KEY", "REQUEST_ID_KEY"]

CLIENT_ID_KEY = "tierfs-client-id"
REQUEST_ID_KEY = "tierfs-request-id"
#: Set by a follower on a call it forwards to the leader (gRPC address of the
#: follower): the receiver never forwards it again.
FORWARDED_KEY = "tierfs-forwarded"
#: Trailing metadata of a reply a follower forwarded: the leader's gRPC
#: address, so the client can go there directly next time.
LEADER_KEY = "tierfs-leader-addr"
#: The ops a Batch item may hold (BatchItem.op), and the RPC each one is on its
#: own: its permission check and its reply type.
BATCH_RPCS = {"mkdir": "Mkdir", "rename": "Rename", "unlink": "Unlink", "rmdir": "Rmdir", "symlink": "Symlink"}
