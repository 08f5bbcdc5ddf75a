"""The ``tierfs`` command: argument parsing, output (tables and progress bars
for people, ``--json`` for scripts) and exit codes, over the functions in
:mod:`tierfs.cli.cluster` and :mod:`tierfs.cli.fs` that do the work.

Exit codes: 0 success; 1 the operation failed (the message says why: no such
file, cluster unreachable, ...); 2 bad usage; 3 ``status`` found the cluster
degraded; 130 interrupted. Expected errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import stat as _stat
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import IO, Any, TextIO, TypeVar

from tierfs.cli.fs import LocalFileError
from tierfs.cli.tree import DEFAULT_JOBS, TreeProgress
from tierfs.cli.util import (
    DEFAULT_DATA,
    human_rate,
    human_size,
    parse_chunk_size_arg,
    parse_seconds,
    resolve_meta,
    shown,
    terminal_safe,
)
from tierfs.cli.util import table as _table
from tierfs.errors import TierFSError, UnavailableError
from tierfs.tls import default_data_dir

__all__ = ["EXIT_DEGRADED", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main", "render_status", "run"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DEGRADED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

T = TypeVar("T")


# ---- the parser ------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors through ``_UsageError`` (so ``run``
    returns 2 instead of the process exiting from inside a library call)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _UsageError(f"{self.prog}: {message}\n{self.format_usage().rstrip()}")


class _UsageError(Exception):
    pass


def _common(p: argparse.ArgumentParser, *, top: bool, meta: bool = True) -> None:
    # On sub-commands the defaults are SUPPRESS so that an option given before
    # the command (``tierfs --json ls``) is not reset by the sub-parser.
    d: Any = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    g = p.add_argument_group("cluster options")
    if meta:
        g.add_argument("--meta", default=d(None), metavar="HOST:PORT,...",
                       help="meta replica addresses (default: $TIERFS_META, else DATA/cluster.toml)")
    g.add_argument("--data", default=d(None), metavar="DIR",
                   help=f"local cluster directory (up/down; status pids; its admin.token is the default "
                        f"credential; default {DEFAULT_DATA})")
    g.add_argument("--token-file", default=d(None), metavar="FILE",
                   help="credential for meta (default: $TIERFS_TOKEN, $TIERFS_TOKEN_FILE, else DATA/admin.token)")
    g.add_argument("--json", action="store_true", default=d(False), help="print JSON for scripts")
    g.add_argument("--timeout", type=parse_seconds, default=d(20.0), metavar="SECONDS",
                   help="give up on an unreachable cluster after this long (default 20)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tierfs", description="TierFS admin and file tool.",
                 epilog="Run `tierfs up` for a local cluster; `tierfs COMMAND -h` for a command's options.")
    _common(ap, top=True)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    def cmd(name: str, help: str, meta: bool = True, **kw: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, **kw)
        _common(p, top=False, meta=meta)
        return p

    def tree_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("-r", "--recursive", action="store_true",
                       help="copy a directory tree (cp -r: into DEST if it is a directory, else as DEST)")
        p.add_argument("-j", "--jobs", type=int, default=DEFAULT_JOBS, metavar="N",
                       help=f"files copied at once with -r (default {DEFAULT_JOBS})")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
        p.add_argument("--no-preserve", dest="preserve", action="store_false",
                       help="with -r: do not keep permission bits and modification times")

    # For `up`, --meta is the number of replicas to start (there are no addresses yet).
    p = cmd("up", "start a local cluster in the background (or reuse a running one)", meta=False)
    p.add_argument("--meta-replicas", "--meta", "-m", dest="n_meta", type=int, default=3, metavar="N",
                   help="meta replicas (odd; default 3)")
    p.add_argument("--storage", "-s", dest="n_storage", type=int, default=None, metavar="N",
                   help="storage daemons (default 6: ec:4+2 on distinct nodes); on a running cluster, adds "
                        "daemons up to N")
    p.add_argument("--targets-per-node", "-t", type=int, default=1, metavar="N", help="targets per daemon")
    p.add_argument("--tls", action="store_true",
                   help="make a local CA under DATA/tls/ and run every daemon with mutual TLS (a cluster made "
                        "with it stays TLS; off by default on loopback)")
    cmd("down", "stop the local cluster (its data stays)", meta=False)
    p = cmd("status", "daemons, targets and placement groups; exit 3 if degraded")
    p = cmd("put", "copy a local file (- for stdin), or a tree with -r, into TierFS")
    p.add_argument("local")
    p.add_argument("remote")
    tree_opts(p)
    p.add_argument("-L", "--dereference", action="store_true",
                   help="with -r: copy what symbolic links point to (default: copy the links as links)")
    p = cmd("get", "copy a TierFS file to a local file (- for stdout), or a tree with -r")
    p.add_argument("remote")
    p.add_argument("local")
    tree_opts(p)
    # -h is "human-readable" here, as in du(1)/df(1); --help still helps.
    p = cmd("du", "logical and stored (with redundancy) sizes of trees", add_help=False)
    p.add_argument("paths", nargs="*", default=["/"], metavar="PATH")
    p.add_argument("-s", "--summarize", action="store_true", help="one line per PATH (default: every directory)")
    p.add_argument("-h", "--human-readable", dest="human", action="store_true", help="sizes as KiB, MiB, ...")
    p.add_argument("--help", action="help", help="show this help message and exit")
    p = cmd("df", "capacity, use and free space per target, node, file groups and KV pool", add_help=False)
    p.add_argument("-h", "--human-readable", dest="human", action="store_true", help="sizes as KiB, MiB, ...")
    p.add_argument("--help", action="help", help="show this help message and exit")
    p = cmd("cat", "write a TierFS file to standard output")
    p.add_argument("remote")
    p = cmd("ls", "list directories (or show files)")
    p.add_argument("path", nargs="*", default=["/"])
    p.add_argument("-l", dest="long", action="store_true", help="long format")
    p.add_argument("-a", dest="all", action="store_true", help="accepted for ls -la: every entry is always shown")
    p = cmd("stat", "attributes and layout of a file or directory")
    p.add_argument("path")
    p = cmd("mkdir", "make directories")
    p.add_argument("path", nargs="+")
    p.add_argument("-p", dest="parents", action="store_true", help="make parents; no error if it exists")
    p = cmd("rm", "remove files or empty directories")
    p.add_argument("path", nargs="+")
    p.add_argument("-r", dest="recursive", action="store_true", help="remove a directory and its contents")
    p = cmd("mv", "rename or move")
    p.add_argument("src")
    p.add_argument("dst")
    p = cmd("chmod", "set permission bits (octal, e.g. 755 or 1777; owner or root)")
    p.add_argument("mode")
    p.add_argument("path", nargs="+")
    p = cmd("chown", "set owner and/or group: UID, UID:GID or :GID (numbers; root changes the owner)")
    p.add_argument("owner")
    p.add_argument("path", nargs="+")
    p = cmd("set-layout", "layout of new files under a directory")
    p.add_argument("path")
    p.add_argument("--redundancy", default="", help="ec:K+M or replica:N (e.g. ec:4+2)")
    p.add_argument("--chunk-size", type=parse_chunk_size_arg, default=None, help="power of two, e.g. 4MiB")
    p.add_argument("--stripe", type=int, default=None, metavar="N", help="placement groups a file spreads over")
    from tierfs.cli import repair

    repair.add_commands(cmd)
    from tierfs.cli import kv

    kv.add_commands(cmd, lambda p: _common(p, top=False))
    from tierfs.cli import mount

    mount.add_commands(cmd)
    from tierfs.cli import users

    users.add_commands(cmd)
    from tierfs.cli import rebalance

    rebalance.add_commands(cmd)
    from tierfs.cli import placement

    placement.add_commands(cmd)
    from tierfs.cli import members

    members.add_commands(cmd)
    return ap


# ---- output ------------------------------------------------------------------------


#: Under a table where a USED figure is marked ``*``.
UNREPORTED_NOTE = ("* used as last committed, up to meta's usage_interval (30 s) old: the meta leader has had no "
                   "report from the node since it took over (a failover a moment ago, or the node is down)")


def _meta_table(st: dict[str, Any]) -> str:
    """The META table; its PID column only where some pid is known (a local
    cluster's daemons, with --data)."""
    pids = any(m.get("pid") for m in st["meta"])
    out = _table([[m["id"], m["addr"], m["role"], m["state"] + ("" if m.get("member", True) else ", not a member"),
                   *([m["pid"]] if pids else [])] for m in st["meta"]],
                 ["META", "ADDRESS", "ROLE", "STATE", *(["PID"] if pids else [])])
    why = [f"  {m['addr']}: {m['error']}" for m in st["meta"] if m.get("error")]
    return out + ("\n" + "\n".join(why) if why else "")


def _repair_failure_lines(f: dict[str, Any] | None) -> list[str]:
    """Under "fragments awaiting repair": the chunks no node could rebuild
    (too few fragments readable) and the nodes' last repair errors."""
    if not f:
        return []
    out = []
    lost = f["unrebuildable"]
    if lost:
        out.append(f"DATA AT RISK: {len(lost)} chunk(s) cannot be rebuilt: too few of their fragments can be read "
                   "(lost unless a node holding one comes back; `tierfs scrub --no-repair` lists them by inode):")
        out += [f"  inode {u['inode']} chunk {u['chunk']} generation {u['generation']:#x}: {u['detail']}"
                for u in lost[:10]]
        if len(lost) > 10:
            out.append(f"  ... and {len(lost) - 10} more (--json lists them)")
    for e in f["errors"]:
        if not lost or "InsufficientTargetsError" not in e["error"]:
            out.append(f"repair failing on node {e['node']} ({e['errors']} failed attempts so far; retried): "
                       f"{e['error']}")
    return out


def render_status(st: dict[str, Any]) -> str:
    """The ``tierfs status`` tables."""
    if st.get("no_leader"):
        out = [f"cluster: DEGRADED  ({st['no_leader']})", ""]
        out.append(_meta_table(st))
        return "\n".join(out)
    out = [f"cluster: {'healthy' if st['healthy'] else 'DEGRADED'}  (map version {st['map_version']}, "
           f"{human_size(st['used'])} used of {human_size(st['capacity'])})", ""]
    if st.get("security", "on") != "on":
        out[-1:] = [f"security: {st['security'].upper()} (meta runs with --insecure-no-auth on "
                    f"{'some replicas' if st['security'] == 'mixed' else 'every replica'}: any caller is admin)", ""]
    else:
        out[-1:] = ["security: on (every meta call authenticated)", ""]
    if st.get("repairs_pending"):
        out[-1:] = [f"fragments awaiting repair: {st['repairs_pending']} (missing since a degraded write or "
                    "found bad by scrub; the nodes holding their positions rebuild them)", ""]
        out[-1:] = [*_repair_failure_lines(st.get("repair_failures")), ""]
    out.append(_meta_table(st))
    out.append("")
    # PIDs are known for a local cluster's daemons (--data) only: no column
    # of dashes for a remote one.
    pids = any(s.get("pid") for s in st["storage"])
    rows = []
    for s in st["storage"]:
        ts = s["targets"] or [None]
        for i, t in enumerate(ts):
            node = s["id"] if not s.get("name") else f"{s['id'] or '-'} ({s['name']})"
            state = s["state"] + (" (draining)" if s.get("draining") else "")
            head = [node, s["data_addr"], state, *([s["pid"]] if pids else [])] if i == 0 else [""] * (3 + pids)
            tail = ([t["id"], t["state"], human_size(t["used"]) + ("*" if t.get("used_unreported") else ""),
                     human_size(t["capacity"]), t["path"]]
                    if t else [None] * 5)
            rows.append(head + tail)
    if rows:
        out.append(_table(rows, ["NODE", "DATA ADDRESS", "STATE", *(["PID"] if pids else []), "TARGET", "TSTATE",
                                 "USED", "CAPACITY", "PATH"]))
    else:
        out.append("storage: no storage node has registered: nothing can be stored until one does "
                   "(start tierfs-storage with this cluster's meta addresses and node key)")
    if any(t and t.get("used_unreported") for s in st["storage"] for t in s["targets"]):
        out.append(UNREPORTED_NOTE)
    out.append("")
    by_state: dict[str, list[int]] = {}
    for g in st["groups"]:
        by_state.setdefault(g["state"], []).append(g["id"])
    out.append("groups: " + ("; ".join(f"{len(ids)} {s}" + ("" if s == "healthy" else f" {ids}")
                                       for s, ids in sorted(by_state.items())) or "none"))
    for g in st["groups"]:
        rb = g.get("rebuild")
        if rb:
            dark = rb.get("unreachable")
            if dark and len(dark) == len(rb["targets"]):
                out.append(f"  group {g['id']}: rebuilding target(s) {rb['targets']}: progress unknown (their "
                           f"node does not answer)")
                continue
            out.append(f"  group {g['id']}: rebuilding target(s) {rb['targets']}: {rb['done']}/{rb['total']} chunks, "
                       f"{human_size(rb['bytes'])} written" + (f" ({rb['error']})" if rb.get("error") else "")
                       + (f"; target(s) {dark}: node does not answer" if dark else ""))
    if st.get("rebalance"):
        from tierfs.cli.rebalance import rebalance_line, stuck_lines

        out += [rebalance_line(st["rebalance"]), *stuck_lines(st["rebalance"]), st["rebalance"]["failure_domain"]]
    if st.get("kv_leases"):
        out.append(kv_lease_line(st["kv_leases"]))
    if "kv_pools" in st:
        from tierfs.cli.kv import render_pools

        out += ["", render_pools(st["kv_pools"], per_target=True)]
    return "\n".join(out)


def kv_lease_line(kl: dict[str, Any]) -> str:
    """One line on the KV map leases (the leader's view)."""
    n, v = len(kl["nodes"]), kl["map_version"]
    if kl["stalled"]:
        behind = sorted({x["applied_map_version"] for x in kl["nodes"] if x["stalled"]})
        return (f"kv leases: node(s) {kl['stalled']} hold no KV map lease (their KV gets miss and puts are "
                f"refused); they report map version(s) {behind} applied, meta is at {v}: see their logs")
    leased = sum(x["leased"] for x in kl["nodes"])
    online = kl.get("online_nodes", n)
    if kl["published"] >= v:
        effect = f"map version {v} in effect on every leased node"
    elif kl["published"]:
        effect = f"map version {v} taking effect (version {kl['published']} in effect on every leased node)"
    else:  # a new leader: nodes it has not heard from hold changes back for up to one lease
        effect = f"map version {v} taking effect (a new leader waits for every node to report, up to one lease)"
    return f"kv leases: {leased} of {online} online storage nodes leased; {effect}"


def _ls_long(entries: list[dict[str, Any]]) -> str:
    rows = []
    for e in entries:
        mtime = datetime.datetime.fromtimestamp(e["mtime"]).strftime("%Y-%m-%d %H:%M")
        rows.append([_stat.filemode(int(e["mode"], 8)), e["size"], mtime, e["redundancy"] or "",
                     e["path"].rsplit("/", 1)[-1] + ("/" if e["type"] == "directory" else "")
                     + (f" -> {e['target']}" if "target" in e else "")])
    header = ["MODE", "SIZE", "MODIFIED", "LAYOUT", "NAME"]
    if not any(r[3] for r in rows):  # only files carry a layout; none here
        rows = [r[:3] + r[4:] for r in rows]
        header = header[:3] + header[4:]
    return _table(rows, header) if rows else ""


def _stat_text(s: dict[str, Any]) -> str:
    lay = s["layout"]
    lines = [
        f"  path: {s['path']}", f"  type: {s['type']}", f"  inode: {s['inode']}",
        f"  size: {s['size']} ({human_size(s['size'])})", f"  mode: {_stat.filemode(int(s['mode'], 8))}",
        f"  uid/gid: {s['uid']}/{s['gid']}",
        f"  modified: {datetime.datetime.fromtimestamp(s['mtime']).isoformat(sep=' ', timespec='seconds')}",
    ]
    if "target" in s:
        lines.append(f"  target: {s['target']}")  # a symbolic link: no layout of its own
    else:
        lines.append(f"  layout: {lay['redundancy']}, chunk {human_size(lay['chunk_size'])}, "
                     f"stripe {lay['stripe_width']}" + (f", groups {lay['groups']}" if lay["groups"] else ""))
    if s["type"] == "file":
        lines.append(f"  chunks: {s['chunks']}" + ("  (a writer has it open)" if s["writing"] else ""))
    return "\n".join(lines)


class _Bar:
    """A rich progress bar with throughput on stderr (only on a terminal)."""

    def __init__(self, label: str, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                           TransferSpeedColumn(), TimeRemainingColumn(),
                           console=Console(file=stream), transient=True)
        self._task = self._p.add_task(label, total=None)

    def __enter__(self) -> _Bar:
        self._p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._p.stop()

    def __call__(self, done: int, total: int | None) -> None:
        self._p.update(self._task, completed=done, total=total)


class _TreeLines:
    """Tree-copy progress as a line on stderr at most once a second (for logs
    and pipes), and a last line when the copy ends."""

    def __init__(self, label: str, stream: TextIO, interval: float = 1.0) -> None:
        self._label, self._stream, self._interval = label, stream, interval
        self._next = 0.0
        self._last: TreeProgress | None = None

    def line(self, p: TreeProgress) -> str:
        return (f"{self._label}: {p.files_done}/{p.files_total} files, {human_size(p.bytes_done)} / "
                f"{human_size(p.bytes_total)}, {human_rate(p.bytes_done, p.seconds)}"
                + (f", {p.errors} failed" if p.errors else ""))

    def __enter__(self) -> _TreeLines:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._last is not None:
            self._stream.write(self.line(self._last) + "\n")
            self._stream.flush()

    def __call__(self, p: TreeProgress) -> None:
        self._last = p
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._interval
            self._stream.write(self.line(p) + "\n")
            self._stream.flush()


class _TreeBar:
    """Tree-copy progress as a rich bar on a terminal: bytes, rate, time
    left, and files done of the total."""

    def __init__(self, label: str, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                           TransferSpeedColumn(), TextColumn("{task.fields[files]}"), TimeRemainingColumn(),
                           console=Console(file=stream), transient=True)
        self._task = self._p.add_task(label, total=None, files="")

    def __enter__(self) -> _TreeBar:
        self._p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._p.stop()

    def __call__(self, p: TreeProgress) -> None:
        self._p.update(self._task, completed=p.bytes_done, total=p.bytes_total or None,
                       files=f"{p.files_done}/{p.files_total} files" + (f", {p.errors} failed" if p.errors else ""))


def _tree(ns: argparse.Namespace, out: TextIO, err: TextIO, env: Any, tty: bool,
          emit: Callable[[Any, str | None], None]) -> int:
    """``put -r`` / ``get -r``: progress on stderr (a bar on a terminal, else
    a line a second; none with -q or --json), then the summary; exit 1 if any
    file failed (each is named on stderr)."""
    from tierfs.cli import tree

    if ns.jobs < 1:
        raise _UsageError(f"tierfs {ns.cmd}: --jobs must be at least 1, got {ns.jobs}")
    src = ns.local if ns.cmd == "put" else ns.remote
    label = f"{ns.cmd} -r {os.path.basename(os.path.normpath(src)) or src}"
    shown: Any = None
    if not ns.quiet and not ns.json:
        shown = _TreeBar(label, err) if tty else _TreeLines(label, err)
    if ns.cmd == "put":
        fn: Callable[..., Any] = tree.put_tree
        args: tuple[str, str] = (ns.local, ns.remote)
        kw: dict[str, Any] = {"follow_symlinks": ns.dereference}
    else:
        fn, args, kw = tree.get_tree, (ns.remote, ns.local), {}
    with shown if shown is not None else contextlib.nullcontext():
        r = _client_call(ns, env, fn, *args, jobs=ns.jobs, progress=shown, preserve=ns.preserve, **kw)
    for e in r["errors"]:
        err.write(terminal_safe(f"tierfs: {ns.cmd} -r: {e['path']}: {e['error']}\n"))
    if not ns.quiet:
        for e in r["skipped"]:
            err.write(terminal_safe(f"tierfs: {ns.cmd} -r: skipped {e['path']}: {e['reason']}\n"))
    emit(r, f"{r['src']} -> {r['dst']}: {r['files']} of {r['files_total']} files, {r['dirs']} directories, "
            f"{r['symlinks']} symlinks, {human_size(r['bytes'])} in {r['seconds']:.2f} s "
            f"({human_rate(r['bytes'], r['seconds'])})" + (f"; {len(r['errors'])} FAILED" if r["errors"] else ""))
    return EXIT_FAILED if r["errors"] else EXIT_OK


def _du_text(r: dict[str, Any], human: bool) -> str:
    size: Callable[[int], str] = human_size if human else str
    rows = [[size(x["bytes"]), size(x["stored"]) + ("+?" if x["unknown"] else ""), x["files"], x["path"]]
            for x in r["rows"]]
    if len(r["paths"]) > 1:
        t = r["total"]
        rows.append([size(t["bytes"]), size(t["stored"]) + ("+?" if t["unknown"] else ""), t["files"], "total"])
    return _table(rows, ["SIZE", "STORED", "FILES", "PATH"])


def _df_text(r: dict[str, Any], human: bool) -> str:
    size: Callable[[int], str] = human_size if human else str

    def pct(used: int, cap: int) -> str:
        return f"{100 * used / cap:.0f}%" if cap else "-"

    racks = any(t["rack"] for t in r["targets"])
    rows = []
    for t in r["targets"]:
        rows.append([t["id"], t["node"], t["hostname"] or None] + ([t["rack"] or None] if racks else [])
                    + [t["state"] if t["node_state"] == "online" else f"{t['state']} (node {t['node_state']})",
                       size(t["capacity"]), size(t["used"]) + ("*" if t.get("used_unreported") else ""),
                       size(t["free"]), pct(t["used"], t["capacity"]), t["path"]])
    tot = r["total"]
    rows.append(["total", "", ""] + ([""] if racks else []) + [
        f"{tot['targets']} targets", size(tot["capacity"]), size(tot["used"]), size(tot["free"]),
        pct(tot["used"], tot["capacity"]), ""])
    out = [_table(rows, ["TARGET", "NODE", "HOST"] + (["RACK"] if racks else [])
                  + ["STATE", "SIZE", "USED", "FREE", "USE%", "PATH"])]
    if any(t.get("used_unreported") for t in r["targets"]):
        out.append(UNREPORTED_NOTE)
    fg = r["file_groups"]
    out += ["", f"files: {fg['groups']} placement groups"
            + (" (" + ", ".join(f"{c} of width {w}" for w, c in fg["by_width"].items()) + ")" if fg["groups"] else "")]
    if r["kv_pools"]:
        out += ["", _table([[p["name"], p["redundancy"], p["targets"], size(p["memory_budget"]),
                             size(p["memory_used"]), size(p["disk_budget"]), size(p["disk_used"]), p["objects"]]
                            for p in r["kv_pools"]],
                           ["KV POOL", "REDUNDANCY", "TARGETS", "MEM BUDGET", "MEM USED", "DISK BUDGET",
                            "DISK USED", "OBJECTS"])]
    return "\n".join(out)


# ---- running ---------------------------------------------------------------------


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    import uvloop

    return uvloop.run(coro)


def _client_call(ns: argparse.Namespace, env: Any, fn: Callable[..., Coroutine[Any, Any, T]],
                 *args: Any, **kw: Any) -> T:
    from tierfs.client import AsyncClient

    meta = resolve_meta(ns.meta, ns.data, env)

    async def go() -> T:
        async with AsyncClient(meta, meta_deadline=ns.timeout,
                               meta_attempt_timeout=min(3.0, ns.timeout)) as client:
            return await fn(client, *args, **kw)

    return _run_async(go())


def _execute(ns: argparse.Namespace, out: TextIO, err: TextIO, env: Any, tty: bool) -> int:
    from tierfs.cli import cluster, fs

    def emit(data: Any, text: str | None) -> None:
        if ns.json:
            out.write(json.dumps(data, indent=2, default=str) + "\n")
        elif text:
            out.write(terminal_safe(text) + "\n")

    c = ns.cmd
    if c == "up":
        data_dir = ns.data or DEFAULT_DATA
        # Usage errors (exit 2), before anything is made.
        if ns.n_meta < 1 or ns.n_meta % 2 == 0:
            raise _UsageError(f"tierfs up: --meta-replicas must be an odd number >= 1 (a Raft majority), "
                              f"not {ns.n_meta}")
        if ns.n_storage is not None and not 1 <= ns.n_storage <= cluster.MAX_LOCAL_STORAGE:
            raise _UsageError(f"tierfs up: --storage must be between 1 and {cluster.MAX_LOCAL_STORAGE} on one "
                              f"machine, not {ns.n_storage}")
        if ns.targets_per_node < 1:
            raise _UsageError(f"tierfs up: --targets-per-node must be >= 1, not {ns.targets_per_node}")
        if not ns.json:
            err.write(f"starting the local cluster in {os.path.abspath(data_dir)} ...\n")
            err.flush()
        t0 = time.perf_counter()
        r = cluster.cluster_up(data_dir, n_meta=ns.n_meta, n_storage=ns.n_storage,
                               targets_per_node=ns.targets_per_node, timeout=max(ns.timeout, 60.0),
                               tls=ns.tls)
        if not ns.json:
            k = r["counts"]
            shape = f"{k['meta']} meta, {k['storage']} storage x {k['targets_per_node']} target(s)"
            if r["added"]:
                err.write(f"added storage daemons {', '.join(r['added'])}; placement rebalances onto them "
                          f"(`tierfs rebalance status`)\n")
            elif r["reused"] and (k["meta"], k["storage"], k["targets_per_node"]) != (
                    ns.n_meta, ns.n_storage or k["storage"], ns.targets_per_node):
                err.write(f"note: {r['data_dir']} already holds a cluster ({shape}); it is reused as planned "
                          "(remove the directory for a different shape)\n")
            if r["already_running"]:
                err.write(f"already running ({shape}); nothing to do\n")
            else:
                n = len(r["started"])
                err.write(f"started {n} daemon{'s' if n != 1 else ''} ({shape}) in {time.perf_counter() - t0:.1f} s; "
                          f"every daemon up (`tierfs status` checks targets and groups). "
                          f"Stop with: tierfs down --data {data_dir}\n")
            if r["read_only_targets"]:
                ro = r["read_only_targets"]
                where = ", ".join(human_size(t["free"]) + " free in " + t["path"] for t in ro[:3])
                err.write(f"warning: {len(ro)} of {r['targets']} storage targets are read-only: their disk has "
                          f"too little free space ({where}{', ...' if len(ro) > 3 else ''}; a target takes no "
                          f"writes under reserved_bytes + "
                          f"min_free, 320 MiB by default). "
                          + ("Every write will fail with NoSpace until space is freed. "
                             if len(ro) == r["targets"] else "")
                          + "Free space there, or start the cluster on a bigger disk (--data DIR)\n")
            root = r.get("root_layout") or "ec:4+2"
            width = _layout_width(root)
            if width and int(k["storage"]) < width:
                # `tierfs status` calls such a cluster healthy while every put
                # under the root's layout fails: say so now (until stop 49
                # this said ec:4+2 whatever the root's layout had been set to).
                n_rep = min(int(k["storage"]), 3)
                err.write(f"note: new files under / get {root}, which needs {width} storage nodes; with "
                          f"{k['storage']}, give them a layout that fits, e.g. tierfs set-layout / --redundancy "
                          f"replica:{n_rep} --data {data_dir}\n")
            err.write(f"security on: admin token {r['admin_token']}, node key {r['node_key']}, cluster secret "
                      f"{r['cluster_secret']} (mode 0600; commands run here use the admin token)\n")
            if r["metrics"]:
                err.write("meta metrics (Prometheus): " + ", ".join(f"{n} http://{a}/metrics"
                                                                  for n, a in r["metrics"].items()) + "\n")
            if r.get("storage_metrics"):
                err.write("storage metrics (Prometheus): " + ", ".join(
                    f"{n} http://{a}/metrics" for n, a in r["storage_metrics"].items()) + "\n")
            if r["tls_ca"]:
                err.write(f"TLS: CA {r['tls_ca']} (clients under --data {data_dir} use it and its client.pem; "
                          "elsewhere set TIERFS_TLS_CA, TIERFS_TLS_CERT, TIERFS_TLS_KEY)\n")
        emit(r, r["export"])
        return EXIT_OK
    if c == "down":
        data_dir = ns.data or DEFAULT_DATA
        r = cluster.cluster_down(data_dir)
        emit(r, f"stopped {len(r['stopped'])} daemons in {r['data_dir']} (data kept)" if r["stopped"]
             else f"nothing was running in {r['data_dir']}")
        return EXIT_OK
    if c == "status":
        meta = resolve_meta(ns.meta, ns.data, env)
        local = ns.data or (DEFAULT_DATA if not ns.meta and not env.get("TIERFS_META")
                            and os.path.exists(os.path.join(DEFAULT_DATA, "cluster.toml")) else None)
        st = _run_async(cluster.cluster_status(meta, data_dir=local, timeout=min(ns.timeout, 10.0)))
        emit(st, render_status(st))
        return EXIT_OK if st["healthy"] else EXIT_DEGRADED
    if c == "get" and ns.local == "-":
        c = "cat"  # `get REMOTE -`: to standard output
    if c in ("put", "get") and ns.recursive:
        return _tree(ns, out, err, env, tty, emit)
    if c == "du":
        from tierfs.cli import usage

        r = _client_call(ns, env, usage.du, ns.paths, summarize=ns.summarize)
        emit(r, _du_text(r, ns.human))
        for e in r["errors"]:
            err.write(terminal_safe(f"tierfs: du: {e['path']}: {e['error']}\n"))
        return EXIT_FAILED if r["errors"] else EXIT_OK
    if c == "df":
        from tierfs.cli import usage

        r = _run_async(usage.df(resolve_meta(ns.meta, ns.data, env), timeout=ns.timeout))
        emit(r, _df_text(r, ns.human))
        return EXIT_OK
    if c in ("put", "get"):
        show = tty and not ns.json and not ns.quiet
        label = os.path.basename(ns.local if c == "put" else ns.remote.rstrip("/")) or ns.remote
        bar = _Bar(f"{c} {label}", err) if show else None
        fn = fs.put if c == "put" else fs.get
        a, b = (ns.local, ns.remote) if c == "put" else (ns.remote, ns.local)
        if bar is not None:
            with bar:
                r = _client_call(ns, env, fn, a, b, progress=bar)
        else:
            r = _client_call(ns, env, fn, a, b)
        src, dst = (r["local"], r["remote"]) if c == "put" else (r["remote"], r["local"])
        emit(r, f"{src} -> {dst}: {human_size(r['bytes'])} in {r['seconds']:.2f} s "
                f"({human_rate(r['bytes'], r['seconds'])})")
        return EXIT_OK
    if c == "cat":
        stream: IO[bytes] = out.buffer if hasattr(out, "buffer") else sys.stdout.buffer
        _client_call(ns, env, fs.cat, ns.remote, stream)
        return EXIT_OK
    if c == "ls":
        def listing(entries: list[dict[str, Any]]) -> str:
            return _ls_long(entries) if ns.long else "\n".join(
                shown(e["path"].rsplit("/", 1)[-1]) + ("/" if e["type"] == "directory" else "") for e in entries)

        if len(ns.path) == 1:
            entries = _client_call(ns, env, fs.ls, ns.path[0])
            emit(entries, listing(entries))
            return EXIT_OK
        # Several paths, as ls(1): each under its name; one failing does not stop the others.
        r = _client_call(ns, env, fs.each, fs.ls_one, ns.path)
        for e in r["errors"]:
            err.write(terminal_safe(f"tierfs: {e['message']}\n"))
        emit(r, "\n\n".join(f"{shown(x['path'])}:\n{listing(x['entries'])}" for x in r["results"]))
        return EXIT_FAILED if r["errors"] else EXIT_OK
    if c == "stat":
        s = _client_call(ns, env, fs.stat, ns.path)
        emit(s, _stat_text(s))
        return EXIT_OK
    if c in ("mkdir", "rm"):
        one: Callable[..., Coroutine[Any, Any, dict[str, Any]]] = fs.mkdir if c == "mkdir" else fs.rm
        kw: dict[str, Any] = {"parents": ns.parents} if c == "mkdir" else {"recursive": ns.recursive}
        if c == "rm" and ns.recursive and not ns.json:
            kw["progress"] = _rm_progress(err)
        if len(ns.path) == 1:
            emit(_client_call(ns, env, one, ns.path[0], **kw), None)
            return EXIT_OK
        # Several paths, in order, as mkdir(1) and rm(1) do: one failing does
        # not stop the others; each failure gets its line, and the exit is 1.
        r = _client_call(ns, env, fs.each, one, ns.path, **kw)
        for e in r["errors"]:
            err.write(terminal_safe(f"tierfs: {e['message']}\n"))
        emit(r, None)
        return EXIT_FAILED if r["errors"] else EXIT_OK
    if c == "mv":
        emit(_client_call(ns, env, fs.mv, ns.src, ns.dst), None)
        return EXIT_OK
    if c in ("chmod", "chown"):
        if c == "chmod":
            try:
                mode = int(ns.mode, 8)
            except ValueError:
                mode = -1
            if not 0 <= mode <= 0o7777:
                raise _UsageError(f"tierfs chmod: mode must be octal digits from 0 to 7777, not {ns.mode!r}")
            kw2: dict[str, Any] = {"mode": mode}
        else:
            u, _, g = ns.owner.partition(":")
            try:
                uid = int(u) if u else None
                gid = int(g) if g else None
            except ValueError:
                uid = gid = -1
            if (uid is None and gid is None) or any(v is not None and not 0 <= v < 2**32 - 1 for v in (uid, gid)):
                raise _UsageError(f"tierfs chown: owner is UID, UID:GID or :GID (numbers), not {ns.owner!r}")
            kw2 = {"uid": uid, "gid": gid}
        r = _client_call(ns, env, fs.each, fs.chattr, ns.path, **kw2)
        for e in r["errors"]:
            err.write(terminal_safe(f"tierfs: {e['message']}\n"))
        emit(r, None)
        return EXIT_FAILED if r["errors"] else EXIT_OK
    if c == "set-layout":
        if not (ns.redundancy or ns.chunk_size is not None or ns.stripe is not None):
            raise _UsageError("tierfs set-layout: give at least one of --redundancy, --chunk-size, --stripe")
        # 0 used to read as "not given" (and so did nothing, or the usage line above).
        if ns.chunk_size is not None and ns.chunk_size <= 0:
            raise _UsageError(f"tierfs set-layout: --chunk-size must be a power of two > 0, not {ns.chunk_size}")
        if ns.stripe is not None and ns.stripe <= 0:
            raise _UsageError(f"tierfs set-layout: --stripe must be >= 1, not {ns.stripe}")
        r = _client_call(ns, env, fs.set_layout, ns.path, redundancy=ns.redundancy,
                         chunk_size=ns.chunk_size or 0, stripe=ns.stripe or 0)
        emit(r, f"{r['path']}: new files get {r['redundancy']}, chunk {human_size(r['chunk_size'])}, "
                f"stripe {r['stripe_width'] or 'all groups'}" + (f"\nwarning: {r['warning']}" if r.get("warning") else ""))
        return EXIT_OK
    if c == "kv":
        from tierfs.cli import kv

        # `kv replay --simulate` runs the policies without I/O: it needs no
        # cluster (it failed with "no meta address" where none was set up).
        simulate = getattr(ns, "kv_cmd", None) == "replay" and ns.simulate
        code = kv.execute(ns, [] if simulate else resolve_meta(ns.meta, ns.data, env), emit, _run_async, out=out)
        if code is not None:
            return code
    if c in ("mount", "umount"):
        from tierfs.cli import mount

        code = mount.execute(ns, env, lambda: resolve_meta(ns.meta, ns.data, env), emit)
        if code is not None:
            return code
    if c in ("user", "whoami"):
        from tierfs.cli import users

        code = users.execute(ns, resolve_meta(ns.meta, ns.data, env), emit, _run_async, err)
        if code is not None:
            return code
    if c == "node" and ns.action == "label" and ns.rack is None:
        raise _UsageError("tierfs node label: --rack R is required (--rack '' clears the label)")
    if c == "node" and ns.action == "label" and any(ch < " " or "\x7f" <= ch <= "\x9f" for ch in ns.rack):
        raise _UsageError(f"tierfs node label: a rack label has no control characters, not {ns.rack!r}")
    if c == "rebalance" or (c == "node" and ns.action == "label"):
        from tierfs.cli import rebalance

        code = rebalance.execute(ns, resolve_meta(ns.meta, ns.data, env), emit, _run_async)
        if code is not None:
            return code
    if c == "placement":
        from tierfs.cli import placement

        try:
            code = placement.execute(ns, emit, err)
        except placement.SimulateError as exc:
            raise _UsageError(f"tierfs placement simulate: {exc}") from None
        if code is not None:
            return code
    if c in ("target", "node", "scrub"):
        from tierfs.cli import repair

        code = repair.execute(ns, resolve_meta(ns.meta, ns.data, env), emit, _run_async, err)
        if code is not None:
            return code
    if c == "meta-replica":
        from tierfs.cli import members

        code = members.execute(ns, resolve_meta(ns.meta, ns.data, env), emit, _run_async)
        if code is not None:
            return code
    raise _UsageError(build_parser().format_usage().rstrip())


#: What ``tierfs.tls.unreachable_hint`` adds where a server did answer, and
#: refused the client's TLS: the cluster is running, so asking whether it
#: is only misleads (until stop 49 every TLS refusal ended with it).
_TLS_REFUSALS = ("; TLS handshake failed: ", "; the server closed the connection at once: ")


#: How often ``tierfs rm -r`` says how far it got (a line on stderr; none
#: for a removal that takes less, and none with --json).
RM_PROGRESS_EVERY = 5.0


def _rm_progress(err: TextIO) -> Callable[[int], None]:
    """``tierfs rm -r``'s progress: a line every RM_PROGRESS_EVERY seconds
    (a tree of tens of thousands of files takes minutes; it said nothing)."""
    start = time.monotonic()
    last = {"at": start}

    def shown(n: int) -> None:
        now = time.monotonic()
        if now - last["at"] >= RM_PROGRESS_EVERY:
            last["at"] = now
            err.write(f"rm -r: {n:,} entries removed ({now - start:.0f} s)\n")
            err.flush()

    return shown


def _layout_width(redundancy: str) -> int:
    """Targets a layout's groups need: K+M for "ec:K+M", N for "replica:N" (0: unknown)."""
    kind, _, rest = redundancy.partition(":")
    try:
        if kind == "ec":
            k, _, m = rest.partition("+")
            return int(k) + int(m)
        if kind == "replica":
            return int(rest)
    except ValueError:
        pass
    return 0


def _hint(exc: TierFSError) -> str:
    if (isinstance(exc, UnavailableError) and "unreachable" in str(exc)
            and not any(m in str(exc) for m in _TLS_REFUSALS) and "no meta leader" not in str(exc)):
        return ("\n  is the cluster running? `tierfs up` starts a local one; "
                "check --meta / TIERFS_META and `tierfs status`")
    return ""


#: Options whose value a user may type with a leading '-' (a negative
#: lifetime); argparse took ``--expires -1d`` for two options and said only
#: "expected one argument".
_SIGNED_VALUE_OPTIONS = frozenset({"--expires"})


def _glue_signed_values(args: list[str]) -> list[str]:
    """``--expires -1d`` -> ``--expires=-1d``, so that the option's own check
    says what is wrong with the value."""
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if (a in _SIGNED_VALUE_OPTIONS and i + 1 < len(args) and args[i + 1][:1] == "-"
                and args[i + 1][1:2].isdigit()):
            out.append(f"{a}={args[i + 1]}")
            i += 2
            continue
        if a == "--":
            out.extend(args[i:])
            break
        out.append(a)
        i += 1
    return out


def run(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
        env: dict[str, str] | None = None, tty: bool | None = None) -> int:
    """Run one ``tierfs`` command in-process; returns its exit code.
    ``stdout``/``stderr``/``env`` default to the process's; ``tty`` (progress
    bars) defaults to whether stderr is a terminal."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    env = dict(os.environ) if env is None else env
    args = _glue_signed_values(list(argv if argv is not None else sys.argv[1:]))
    want_json = "--json" in args
    try:
        ns = build_parser().parse_args(args)
        if ns.cmd is None:
            err.write(build_parser().format_help())
            return EXIT_USAGE
        # One credential for every client this command makes (up/down make
        # their own from the cluster's files); a command on `--data DIR`
        # dials with DIR/tls/ (a `tierfs up --tls` cluster) when it is there.
        from tierfs.meta.auth import default_token, resolve_token

        if ns.cmd in ("up", "down", "placement"):
            # Their own credentials, or none: a $TIERFS_TOKEN_FILE naming the
            # admin.token of a cluster not made yet (or just deleted) must
            # not stop `tierfs up` from making it.
            ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        else:
            ctx = default_token(resolve_token(None, getattr(ns, "token_file", None), ns.data or DEFAULT_DATA, env))
        scope = default_data_dir.set(ns.data) if ns.data else None
        try:
            with ctx:
                return _execute(ns, out, err, env, err.isatty() if tty is None else tty)
        finally:
            if scope is not None:
                default_data_dir.reset(scope)
    except _UsageError as exc:
        if want_json:  # as every other error under --json (nothing on stdout until stop 48)
            out.write(json.dumps({"error": {"code": "USAGE", "message": str(exc).split("\n", 1)[0]}}) + "\n")
        err.write(f"{exc}\n")
        return EXIT_USAGE
    except TierFSError as exc:
        if want_json:
            out.write(json.dumps({"error": {"code": exc.code_name, "message": str(exc)}}) + "\n")
        err.write(terminal_safe(f"tierfs: {exc}{_hint(exc)}\n"))
        return EXIT_FAILED
    except LocalFileError as exc:
        if want_json:
            out.write(json.dumps({"error": {"code": "LOCAL_FILE", "message": str(exc)}}) + "\n")
        err.write(terminal_safe(f"tierfs: {exc}\n"))
        return EXIT_FAILED
    except SystemExit as exc:  # -h / --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except KeyboardInterrupt:
        err.write("tierfs: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `tierfs cat f | head`: the reader left; not an error worth a message.
        with_devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(with_devnull, sys.stdout.fileno())
        os.close(with_devnull)
        return EXIT_OK
    except OSError as exc:
        err.write(terminal_safe(f"tierfs: {exc}\n"))
        return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tierfs`` console script."""
    return run(argv)
