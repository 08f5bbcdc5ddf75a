"""Replay a checker op log on a fresh cluster::

    PYTHONPATH=. .venv/bin/python -m tests.checker.replay LOG.json [--layout ec|rep] [--dir DIR] [--meta N]
        [--storage N]

``LOG.json`` is what a failing run saved (``{"root", "seed", "ops",
"violations"}``: what it found is printed first), or
a plain JSON list of operations. To shrink a failure by hand, delete
operations from the list and replay until it stops failing. Exit code 0:
no violation; 1: violations (printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.checker.walk import Checker, CheckerCluster, CheckFailed, Op

LAYOUTS = {"ec": "ec:4+2", "rep": "replica:3"}


def _ops(doc: object) -> list[Op]:
    raw = doc["ops"] if isinstance(doc, dict) else doc
    assert isinstance(raw, list), "expected a list of operations"
    # JSON turned the tuples (and data specs) into lists.
    return [tuple(tuple(a) if isinstance(a, list) else a for a in op) for op in raw]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None,
                    help="default: from the log's root directory name (ec*/rep*)")
    ap.add_argument("--dir", default=None, help="cluster directory (default: a new temporary one)")
    ap.add_argument("--chunk-size", type=int, default=64 << 10)
    ap.add_argument("--meta", type=int, default=None,
                    help="meta replicas (default: 3 when the log kills meta replicas, else 1)")
    ap.add_argument("--storage", type=int, default=7,
                    help="storage daemons at the start (a soak's later walks start with those the "
                         "earlier ones added: 7 + walks before, with TIERFS_CHECKER_GROW)")
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.log).read_text())
    ops = _ops(doc)
    root = str(doc.get("root", "/ec")) if isinstance(doc, dict) else "/ec"
    for v in doc.get("violations", []) if isinstance(doc, dict) else []:
        print(f"the logged run found: {v}")
    # /rep..., /ec... (tests), /soak-rep-SEED, /soak-ec-SEED (the soak)
    kind = a.layout or ("rep" if root.lstrip("/").removeprefix("soak-").startswith("rep") else "ec")
    n_meta = a.meta or (3 if any(str(op[0]).startswith("meta_") for op in ops) else 1)
    env = CheckerCluster(Path(a.dir or tempfile.mkdtemp(prefix="tierfs-replay-")), n_storage=a.storage,
                         n_meta=n_meta)
    try:
        env.cl.export_token()  # security is on: this process's clients and CLI calls use the admin token
        client = env.client()
        client.mkdir(root)
        client.set_layout(root, chunk_size=a.chunk_size, redundancy=LAYOUTS[kind])
        ck = Checker(env, client, root, seed=doc.get("seed") if isinstance(doc, dict) else None)
        # The log already ends with the steps `finish` added: replay them as they are.
        ck.run(ops, finish=False)
        ck.close()
    except CheckFailed as exc:
        print(exc)
        return 1
    finally:
        env.close()
    print(f"replayed {len(ops)} operations: no violation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
