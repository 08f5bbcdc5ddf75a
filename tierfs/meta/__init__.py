"""Metadata service: the Raft-replicated state machine, its journal and snapshots, and its gRPC API."""
