"""Tests of the KV cache (tierfs.kv)."""

from __future__ import annotations

import os
from pathlib import Path

TRACE_NAME = "mooncake_synthetic_trace.jsonl"


def public_trace_path() -> Path:
    """The public KV-reuse trace: $TIERFS_KV_TRACE, else shared/traces/ next
    to the repo or an ancestor of it (CI lays shared/ beside the clone)."""
    env = os.environ.get("TIERFS_KV_TRACE")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for d in here.parents:
        cand = d / "shared" / "traces" / TRACE_NAME
        if cand.is_file():
            return cand
    # Not a skip: the figures are a real check (see tests/skip_policy.py).
    raise AssertionError(f"{TRACE_NAME} not found under any shared/traces/ above {here}; set TIERFS_KV_TRACE")
