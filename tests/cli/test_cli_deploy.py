"""``deploy/``: what can be checked without a docker engine or a Kubernetes
cluster. The example TOML files load through the daemons' real config
loaders; every ``TIERFS_META_*``/``TIERFS_STORAGE_*`` variable the compose
file and manifests set names a real config field; the systemd units pass
``systemd-analyze verify``; the manifests build with ``kubectl kustomize``
and the YAML parses (each where the tool exists here); and a meta replica
plus a storage node configured only through the environment, with host
names instead of IPs, as in the compose file, form a working cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.cli import cluster_status
from tierfs.client.config import ClientConfig
from tierfs.config import load
from tierfs.meta.auth import default_token, write_credentials
from tierfs.meta.config import MetaConfig
from tierfs.meta.secret import ensure_secret_file
from tierfs.security import load_token_file
from tierfs.storage.config import StorageConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_toml_configs_load_through_the_real_loaders() -> None:
    meta: MetaConfig = load(MetaConfig, DEPLOY / "config" / "meta.toml", env={})
    assert meta.node_id == "meta-0" and len(meta.peer_map()) == 2 and meta.fsync
    assert meta.cluster_secret_file and not meta.insecure_no_cluster_secret
    storage: StorageConfig = load(StorageConfig, DEPLOY / "config" / "storage.toml", env={})
    assert len(storage.target_dirs()) == 2 and storage.advertise_host and len(storage.meta_addrs) == 3
    client: ClientConfig = load(ClientConfig, DEPLOY / "config" / "client.toml", env={})
    assert len(client.meta) == 3


def test_environment_variables_in_compose_and_manifests_name_real_fields() -> None:
    fields = {"META": {f.name for f in dataclasses.fields(MetaConfig)},
              "STORAGE": {f.name for f in dataclasses.fields(StorageConfig)}}
    found = 0
    for path in [DEPLOY / "docker-compose.yml", *sorted((DEPLOY / "k8s").glob("*.yaml"))]:
        for role, name in re.findall(r"TIERFS_(META|STORAGE)_([A-Z_]+)", path.read_text()):
            assert name.lower() in fields[role], f"{path.name}: TIERFS_{role}_{name} is no config field"
            found += 1
    assert found > 20
    # every way of running meta points it at a cluster secret (docs/raft.md)
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "k8s" / "meta.yaml"):
        assert "TIERFS_META_CLUSTER_SECRET_FILE" in path.read_text(), path.name
    assert "--cluster-secret-file %d/cluster.secret" in (DEPLOY / "systemd" / "tierfs-meta.service").read_text()
    # The compose file's literal values convert (sizes, lists, ports).
    text = (DEPLOY / "docker-compose.yml").read_text()
    for role, cls in (("META", MetaConfig), ("STORAGE", StorageConfig)):
        env = dict(re.findall(rf"(TIERFS_{role}_[A-Z_]+): \"?([^\"\n}},]+(?:,[^\"\n}} ]+)*)\"?", text))
        env = {k: v for k, v in env.items() if not k.endswith(("_ADVERTISE_HOST", "_NODE_ID"))}
        load(cls, env=env)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_units_verify(tmp_path: Path) -> None:
    venv_bin = Path(sys.executable).parent
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text()
        assert "/opt/tierfs/venv/bin/" in text
        # The units name the installed paths and user; point them at this checkout to verify.
        text = text.replace("/opt/tierfs/venv/bin/", f"{venv_bin}/")
        text = re.sub(r"^(User|Group)=tierfs$", r"\1=root", text, flags=re.M)
        (tmp_path / unit.name).write_text(text)
        r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit.name)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubernetes_manifests_build_with_kustomize() -> None:
    r = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    kinds = re.findall(r"^kind: (\w+)$", r.stdout, flags=re.M)
    assert sorted(kinds) == ["Namespace", "PodDisruptionBudget", "PodDisruptionBudget", "Service", "Service",
                             "StatefulSet", "StatefulSet"]


def test_yaml_parses() -> None:
    import yaml  # PyYAML: a dev dependency, so this runs everywhere the suite does
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert {f"meta-{i}" for i in range(3)} | {f"storage-{i}" for i in range(6)} <= set(compose["services"])
    for p in (DEPLOY / "k8s").glob("*.yaml"):
        assert all(d for d in yaml.safe_load_all(p.read_text()))


@pytest.mark.timeout(60)
def test_daemons_configured_only_by_environment_with_host_names(tmp_path: Path) -> None:
    from tests.cluster import free_ports, wait_for

    raft, grpc_port, data = free_ports(3)
    secret = ensure_secret_file(tmp_path / "cluster.secret")
    admin, node = write_credentials(secret, tmp_path / "creds")  # security on, as deployed
    meta_env = {"TIERFS_META_NODE_ID": "meta-0", "TIERFS_META_RAFT_ADDR": f"localhost:{raft}",
                "TIERFS_META_GRPC_ADDR": f"localhost:{grpc_port}", "TIERFS_META_DATA_DIR": str(tmp_path / "meta"),
                "TIERFS_META_LOG_FORMAT": "json",
                "TIERFS_META_CLUSTER_SECRET_FILE": str(secret)}
    st_env = {"TIERFS_STORAGE_DATA_DIR": str(tmp_path / "storage"),
              "TIERFS_STORAGE_META_ADDRS": f"localhost:{grpc_port}", "TIERFS_STORAGE_HOST": "0.0.0.0",
              "TIERFS_STORAGE_PORT": str(data), "TIERFS_STORAGE_ADVERTISE_HOST": "localhost",
              "TIERFS_STORAGE_TRANSPORTS": "tcp", "TIERFS_STORAGE_NODE_KEY_FILE": str(node)}
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_")}
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for mod, env, name in (("tierfs.meta.daemon", meta_env, "meta"), ("tierfs.storage.daemon", st_env, "st")):
            logs.append(open(tmp_path / f"{name}.log", "wb"))  # noqa: SIM115
            procs.append(subprocess.Popen([sys.executable, "-m", mod], env={**base, **env},
                                          stdout=subprocess.DEVNULL, stderr=logs[-1]))

        def healthy() -> dict[str, object] | None:
            with default_token(load_token_file(admin)):
                st = asyncio.run(cluster_status([f"localhost:{grpc_port}"], timeout=2))
            return st if st["healthy"] and st["storage"] else None

        st = wait_for(healthy, 40, "env-configured cluster healthy", interval=0.3)
        assert st["meta"][0]["id"] == "meta-0"  # type: ignore[index]
        assert st["storage"][0]["data_addr"] == f"localhost:{data}", json.dumps(st)  # type: ignore[index]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
