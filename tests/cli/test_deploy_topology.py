"""``deploy/`` against what it starts, and against the multi-host fixture.

* the compose file conforms to the Compose specification's JSON schema
  (vendored: tests/data/compose-spec.json, Apache-2.0; validated offline
  with tests/jsonschema_lite.py, and with ``jsonschema`` too where it is
  installed);
* every ``TIERFS_*`` variable anywhere under deploy/ is a real config field
  (meta, storage or client), every ``--flag`` given to ``tierfs-meta`` /
  ``tierfs-storage`` is one of the daemon's flags, every ``tierfs``
  sub-command and flag the docs there show exists, every ``python -m``
  module they run exists;
* compose, the Kubernetes manifests and tests/hosts.py describe one
  topology: 3 meta replicas (Raft 7100, gRPC 7000), 6 storage nodes (data
  7200) each with a rack label, one storage pod per node spread over zones.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.hosts import DEPLOY_RACKS, META_GRPC, META_RAFT, STORAGE_PORT
from tests.jsonschema_lite import validate
from tierfs.client.config import ClientConfig
from tierfs.meta.config import MetaConfig
from tierfs.storage.config import StorageConfig

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SCHEMA = REPO / "tests" / "data" / "compose-spec.json"
TEXT_FILES = sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in
                    {".yml", ".yaml", ".toml", ".md", ".service", ".txt", ""})


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_every_volume_a_compose_service_writes_is_made_in_the_image_for_its_user() -> None:
    """A named volume mounted read-write takes its mount point's owner from
    the image; a mount point the image lacks is made by docker, owned by
    root, and the image's user (tierfs) cannot write it. secret-init's
    node-key and admin-token volumes were such: its copy failed, and every
    meta replica waited on it for ever."""
    docker = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    assert re.search(r"^USER tierfs$", docker, re.M), "the image runs as the tierfs user"
    made = set(re.findall(r"mkdir -p ([^&]+)", docker)[-1].split())
    owned = set(re.search(r"chown tierfs:tierfs ([^&]+)", docker).group(1).split())  # type: ignore[union-attr]
    named = set(_compose().get("volumes", {}))
    writable = set()
    for svc in _compose()["services"].values():
        for v in svc.get("volumes", []):
            parts = v.split(":")
            if parts[0] in named and not (len(parts) > 2 and "ro" in parts[2].split(",")):
                writable.add(parts[1])
    assert writable, "no read-write named volumes found"
    assert writable <= made and writable <= owned, (sorted(writable - made), sorted(writable - owned))


def test_compose_file_conforms_to_the_compose_spec_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    doc = _compose()
    assert validate(doc, schema) == []
    # The check can fail: a port that is not a list, a misspelt key, a bad enum value.
    bad = copy.deepcopy(doc)
    bad["services"]["meta-0"]["ports"] = 7000
    bad["services"]["storage-0"]["hostnme"] = "storage-0"
    bad["services"]["cli"]["restart"] = 5
    errors = validate(bad, schema)
    assert len(errors) == 3 and any("hostnme" in e for e in errors), errors
    if importlib.util.find_spec("jsonschema") is not None:  # the reference implementation agrees
        import jsonschema

        assert list(jsonschema.Draft7Validator(schema).iter_errors(doc)) == []
        assert len(list(jsonschema.Draft7Validator(schema).iter_errors(bad))) == 3


def _env_ok(name: str) -> bool:
    meta, storage, client = _fields(MetaConfig), _fields(StorageConfig), _fields(ClientConfig)
    rest = name.removeprefix("TIERFS_").lower()
    if name.startswith("TIERFS_META_") and rest.removeprefix("meta_") in meta:
        return True
    if name.startswith("TIERFS_STORAGE_") and rest.removeprefix("storage_") in storage:
        return True
    return rest in client  # the client reads TIERFS_<FIELD> (TIERFS_META is its meta list)


def test_every_tierfs_variable_under_deploy_is_a_real_config_field() -> None:
    seen: set[str] = set()
    for path in TEXT_FILES:
        for name in re.findall(r"\bTIERFS_[A-Z0-9_]+", path.read_text()):
            if name.endswith("_"):
                continue  # "TIERFS_META_<FIELD>": the prefix, in prose
            assert _env_ok(name), f"{path.relative_to(REPO)}: {name} is no config field of meta, storage or client"
            seen.add(name)
    assert {"TIERFS_STORAGE_RACK", "TIERFS_META_PEERS", "TIERFS_META", "TIERFS_TOKEN_FILE"} <= seen
    assert not _env_ok("TIERFS_STORAGE_RACKS") and not _env_ok("TIERFS_META_PEER")  # the check can fail


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def test_every_daemon_flag_cli_command_and_module_under_deploy_exists() -> None:
    from tierfs.cli.main import build_parser as cli_parser
    from tierfs.meta.daemon import build_parser as meta_parser
    from tierfs.storage.daemon import build_parser as storage_parser

    daemons = {"tierfs-meta": _options(meta_parser()), "tierfs-storage": _options(storage_parser())}
    cli = cli_parser()
    flags = commands = modules = 0
    for path in TEXT_FILES:
        where = path.relative_to(REPO)
        for line in path.read_text().splitlines():
            # A daemon as a command (ExecStart, exec, a compose command), not a resource name.
            for m in re.finditer(r"(?:bin/|exec |\[\"|^\s*)(tierfs-meta|tierfs-storage)((?: +--[a-z][\w-]*(?:[ =][^\s-]\S*)?)+)",
                                 line):
                for flag in re.findall(r"--[a-z][\w-]*", m.group(2)):
                    assert flag in daemons[m.group(1)], f"{where}: {m.group(1)} has no flag {flag}"
                    flags += 1
            for m in re.finditer(r"(?:^|[`\s])tierfs ([a-z][^`\n#|&;)]*)", line):
                words = m.group(1).split()
                p, sub = cli, _subparsers(cli)
                if not words or words[0] not in sub:
                    continue  # prose ("the tierfs user"), not a command
                while words and words[0] in sub:
                    p = sub[words.pop(0)]
                    sub = _subparsers(p)
                for w in words:
                    if w.startswith("--"):
                        assert w.split("=")[0] in _options(p), f"{where}: `tierfs {m.group(1)}`: no flag {w}"
                commands += 1
            for mod in re.findall(r"python3? -m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w.])", line):
                if mod.startswith("tierfs"):
                    assert importlib.util.find_spec(mod) is not None, f"{where}: no module {mod}"
                    modules += 1
    assert flags >= 4 and commands >= 3 and modules >= 2, (flags, commands, modules)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_compose_manifests_and_hosts_fixture_describe_one_topology() -> None:
    svc = _compose()["services"]
    metas = sorted(n for n in svc if re.fullmatch(r"meta-\d+", n))
    storage = sorted((n for n in svc if re.fullmatch(r"storage-\d+", n)), key=lambda n: int(n.split("-")[1]))
    assert metas == ["meta-0", "meta-1", "meta-2"]
    for n in metas:
        env = svc[n]["environment"]
        assert env["TIERFS_META_RAFT_ADDR"] == f"{n}:{META_RAFT}" and env["TIERFS_META_GRPC_ADDR"] == f"{n}:{META_GRPC}"
        peers = sorted(env["TIERFS_META_PEERS"].split(","))
        assert peers == [f"{m}:{META_RAFT}={m}:{META_GRPC}" for m in metas if m != n]
    racks = [svc[n]["environment"]["TIERFS_STORAGE_RACK"] for n in storage]
    assert racks == list(DEPLOY_RACKS)  # six storage nodes, each in its own rack
    for n in storage:
        env = svc[n]["environment"]
        assert str(env["TIERFS_STORAGE_PORT"]) == str(STORAGE_PORT)
        assert env["TIERFS_STORAGE_META_ADDRS"] == ",".join(f"{m}:{META_GRPC}" for m in metas)

    docs = [d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    sts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    meta, st = sts["tierfs-meta"], sts["tierfs-storage"]
    assert meta["spec"]["replicas"] == len(metas) and st["spec"]["replicas"] == len(DEPLOY_RACKS)
    ports = {p["containerPort"] for p in meta["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {META_GRPC, META_RAFT} <= ports
    pod = st["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = _env(container)
    assert env["TIERFS_STORAGE_RACK"] == "$(NODE_ZONE)"
    assert env["NODE_ZONE"] == {"fieldRef": {"fieldPath": "metadata.labels['topology.kubernetes.io/zone']"}}
    assert env["TIERFS_STORAGE_PORT"] == str(STORAGE_PORT)
    # One storage pod per node, spread evenly over zones (racks).
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [t["topologyKey"] for t in anti] == ["kubernetes.io/hostname"]
    spread = pod["topologySpreadConstraints"]
    assert [(s["topologyKey"], s["maxSkew"], s["whenUnsatisfiable"]) for s in spread] == [
        ("topology.kubernetes.io/zone", 1, "DoNotSchedule")]
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert st["spec"]["serviceName"] in names and meta["spec"]["serviceName"] in names


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_storage_statefulset_with_its_rack() -> None:
    r = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    built = list(yaml.safe_load_all(r.stdout))
    st = next(d for d in built if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "tierfs-storage")
    assert "TIERFS_STORAGE_RACK" in _env(st["spec"]["template"]["spec"]["containers"][0])
    assert st["spec"]["template"]["spec"]["containers"][0]["image"] == "tierfs:0.1.0"
