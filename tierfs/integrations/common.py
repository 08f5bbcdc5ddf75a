"""What every engine adapter shares: where the cluster is, which pool, and a
connection checked at start-up so that bad configuration fails there, with a
message naming the setting, and never hangs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierfs.client import Client
from tierfs.errors import ConfigError, PermissionDeniedError, TierFSError, UnauthenticatedError

#: How long start-up waits for the cluster's map before calling it unreachable.
CONNECT_TIMEOUT = 10.0

#: An adapter's client has no local tiers and no write-back, whatever the
#: environment (TIERFS_KV_DRAM_BYTES, TIERFS_KV_SSD_*, TIERFS_KV_WRITE_BACK)
#: or a config file set up for other clients says: the engine's own CPU
#: buffer is the DRAM tier (docs/engines.md), and a store the engine is told
#: is done must be in the cluster, where other instances find it.
NO_LOCAL_TIERS: dict[str, Any] = {"kv_dram_bytes": 0, "kv_ssd_bytes": 0, "kv_ssd_path": "",
                                  "kv_write_back": False}


@dataclass(frozen=True)
class Target:
    """The resolved cluster and pool of one adapter instance."""

    meta: tuple[str, ...]
    pool: str
    #: The settings they came from, for error messages ("extra_config
    #: 'remote_storage_plugin.tierfs.meta'", or "TIERFS_META").
    meta_setting: str
    pool_setting: str
    #: ``config[token_key]`` when given (None: the client's own lookup,
    #: TIERFS_TOKEN and the rest; docs/security.md)
    token: str | None = None
    #: the setting the token came from, for messages
    token_setting: str = "TIERFS_TOKEN"


def resolve(config: Mapping[str, Any] | None, *, meta_key: str, pool_key: str,
            where: str = "", token_key: str | None = None) -> Target:
    """The meta addresses and pool from an engine's config: ``config[meta_key]``
    (a list or a comma-separated string), else ``TIERFS_META``; the pool
    from ``config[pool_key]``, else ``TIERFS_KV_POOL``, else ``default``;
    the token from ``config[token_key]`` (default: ``meta_key`` with its
    trailing "meta" replaced by "token"), else the client's own lookup.
    ``where`` names the config in messages (e.g. "LMCache extra_config")."""
    cfg = dict(config or {})
    prefix = f"{where} " if where else ""
    raw = cfg.get(meta_key)
    meta_setting = f"{prefix}{meta_key!r}"
    if raw in (None, "", []):
        raw, meta_setting = os.environ.get("TIERFS_META", ""), "TIERFS_META"
    if isinstance(raw, str):
        meta = tuple(a.strip() for a in raw.split(",") if a.strip())
    elif isinstance(raw, (list, tuple)) and all(isinstance(a, str) for a in raw):
        meta = tuple(a.strip() for a in raw if a.strip())
    else:
        raise ConfigError(f"must be 'host:port,...' or a list of them, not {raw!r}", field=meta_setting)
    if not meta:
        raise ConfigError(f"no TierFS meta address: set {prefix}{meta_key!r} or TIERFS_META=host:port,...",
                          field=meta_setting)
    for a in meta:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{a!r} is not host:port", field=meta_setting)
    pool = cfg.get(pool_key)
    pool_setting = f"{prefix}{pool_key!r}"
    if pool in (None, ""):
        pool, pool_setting = os.environ.get("TIERFS_KV_POOL", "") or "default", "TIERFS_KV_POOL"
    if not isinstance(pool, str):
        raise ConfigError(f"must be a pool name, not {pool!r}", field=pool_setting)
    if token_key is None:
        token_key = meta_key[: -len("meta")] + "token" if meta_key.endswith("meta") else "token"
    token = cfg.get(token_key)
    if token is not None and not isinstance(token, str):
        raise ConfigError("must be a token string", field=f"{prefix}{token_key!r}")
    token_setting = f"{prefix}{token_key!r}" if token is not None else "TIERFS_TOKEN"
    return Target(meta, pool, meta_setting, pool_setting, token, token_setting)


def connect(target: Target, *, timeout: float = CONNECT_TIMEOUT, **options: Any) -> Client:
    """A blocking :class:`Client` on ``target``, checked now: the cluster
    answers within ``timeout`` and the pool exists. Failures raise
    :class:`ConfigError` naming the setting; nothing is left open."""
    options.setdefault("meta_deadline", timeout)
    options.update(NO_LOCAL_TIERS)
    if target.token is not None:
        options.setdefault("token", target.token)
    client = Client(list(target.meta), kv_pool=target.pool, **options)
    try:
        pools = client._run(_pools(client, timeout))
    except (UnauthenticatedError, PermissionDeniedError) as e:
        # It answered: the credential is what is wrong, not the address.
        client.close()
        how = (f"set {target.token_setting}" if target.token_setting != "TIERFS_TOKEN"
               else "set TIERFS_TOKEN or TIERFS_TOKEN_FILE")
        raise ConfigError(f"the TierFS cluster at {','.join(target.meta)} refused this client's credential "
                          f"({type(e).__name__}: {e}); {how} (or this engine's token setting) to a token of "
                          "the cluster (docs/security.md, 'Client credentials')", field=target.token_setting) from e
    except (TierFSError, OSError, TimeoutError) as e:
        client.close()
        why = str(e) or "no answer"
        raise ConfigError(f"cannot reach the TierFS cluster at {','.join(target.meta)} within {timeout:g} s "
                          f"({type(e).__name__}: {why})", field=target.meta_setting) from e
    except BaseException:
        client.close()
        raise
    if target.pool not in pools:
        client.close()
        raise ConfigError(f"unknown KV pool {target.pool!r} (pools: {', '.join(sorted(pools)) or 'none'}; "
                          "create it with 'tierfs kv pool create')", field=target.pool_setting)
    return client


async def _pools(client: Client, timeout: float) -> set[str]:
    ac = client.aclient
    router = ac._parts()[2]
    await asyncio.wait_for(router.refresh(force=True), timeout)
    return set(router.kv_pools)


def key_component(s: str, limit: int = 96) -> str:
    """``s`` as a key component: readable, bounded, and still unique (a
    digest replaces the tail of a long or unusual name). Two different
    names never give the same component: a name kept as it is has only
    ``[A-Za-z0-9._-]``, and every other one ends in ``~`` and a digest of
    the whole name."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "_"
    if clean == s and len(s) <= limit:
        return s
    # The tail of a path names the model; the digest keeps the whole unique.
    return f"{clean[-(limit - 13):]}~{hashlib.sha256(s.encode()).hexdigest()[:12]}"
