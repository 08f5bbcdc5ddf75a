"""Small helpers shared by the CLI's commands: where the meta replicas are,
human-readable sizes and rates."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tierfs.config import parse_size
from tierfs.errors import ConfigError

__all__ = [
    "DEFAULT_DATA",
    "human_rate",
    "human_size",
    "parse_chunk_size_arg",
    "parse_seconds",
    "parse_seconds_or_zero",
    "parse_size_arg",
    "resolve_meta",
    "shown",
    "table",
    "terminal_safe",
]

#: Where ``tierfs up`` and ``make run`` keep a local cluster by default.
DEFAULT_DATA = "./.tierfs"


def _split(addrs: str) -> list[str]:
    return [a.strip() for a in addrs.split(",") if a.strip()]


def _check(addrs: list[str], source: str) -> list[str]:
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"not a HOST:PORT address: {a!r} (from {source})", field="meta")
    return addrs


def resolve_meta(flag: str | None, data_dir: str | None, env: Mapping[str, str] | None = None) -> list[str]:
    """Meta replica addresses, from the first of: ``--meta``, ``TIERFS_META``,
    ``--data DIR`` (its ``cluster.toml``), ``./.tierfs/cluster.toml``."""
    import tomllib

    env = os.environ if env is None else env
    if flag:
        return _check(_split(flag), "--meta")
    if env.get("TIERFS_META", "").strip():
        return _check(_split(env["TIERFS_META"]), "TIERFS_META")
    candidates = [Path(data_dir)] if data_dir else [Path(DEFAULT_DATA)]
    for d in candidates:
        path = d / "cluster.toml"
        if path.exists():
            try:
                addrs = list(tomllib.loads(path.read_text())["cluster"]["meta"])
            except (tomllib.TOMLDecodeError, KeyError, TypeError, OSError) as exc:
                raise ConfigError(f"{path} is damaged ({exc})", field="meta") from None
            return _check([str(a) for a in addrs], str(path))
        if data_dir:
            raise ConfigError(f"no local cluster in {d.resolve()} (no cluster.toml); "
                              "start one with `tierfs up --data DIR`", field="meta")
    raise ConfigError("no meta address: pass --meta HOST:PORT,... or set TIERFS_META "
                      "(`tierfs up` prints the line to export)", field="meta")


def parse_size_arg(value: str) -> int:
    """``"4MiB"`` -> 4194304 (argparse type)."""
    try:
        return parse_size(value)
    except ValueError as exc:
        import argparse

        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_chunk_size_arg(value: str) -> int:
    """A chunk size (argparse type): a size whose decimal unit makes it no
    power of two (``4M`` is 4,000,000 bytes) is refused with the binary one
    it likely meant (``4MiB``), before meta sees it."""
    import argparse

    n = parse_size_arg(value)
    if n > 0 and n & (n - 1):
        m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe])b?\s*$", value, re.IGNORECASE)
        hint = f" (did you mean {m.group(1)}{m.group(2).upper()}iB?)" if m else ""
        raise argparse.ArgumentTypeError(
            f"{value!r} is {n:,} bytes, not a power of two{hint}: chunk sizes are 64KiB, 128KiB, ... 64MiB")
    return n


def _seconds(value: str, *, zero: bool) -> float:
    import argparse

    try:
        v = float(value)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds {'>= 0' if zero else '> 0'}, not {value!r}")
    return v


def parse_seconds(value: str) -> float:
    """A duration in seconds, finite and > 0 (argparse type: ``nan``, ``inf``
    and ``-1`` are usage errors naming the option)."""
    return _seconds(value, zero=False)


def parse_seconds_or_zero(value: str) -> float:
    """A duration in seconds, finite and >= 0 (argparse type)."""
    return _seconds(value, zero=True)


def human_size(n: float) -> str:
    """1536 -> "1.5 KiB" (binary units, as the layout options use)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_rate(nbytes: int, seconds: float) -> str:
    """Throughput in decimal MB/s (what disks and NICs are sold in); below
    10 MB/s with one decimal, below 1 in kB/s (a 6-byte put read "0 MB/s")."""
    rate = nbytes / max(seconds, 1e-9)
    if rate < 1e6:
        return f"{rate / 1e3:,.1f} kB/s"
    return f"{rate / 1e6:,.1f} MB/s" if rate < 1e7 else f"{rate / 1e6:,.0f} MB/s"


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or f"\\x{ord(c):02x}"


def shown(s: str) -> str:
    """``s`` (a file name, a key) for a terminal: control characters as
    escapes (``\\n``, ``\\x1b``), so a name cannot move the cursor, clear
    the screen or split a table row. JSON output keeps the real bytes."""
    return _CONTROL.sub(_escape, s)


def terminal_safe(text: str) -> str:
    """Human output of several lines: :func:`shown` but for newlines and tabs."""
    return _CONTROL_BUT_LINES.sub(_escape, text)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Left-aligned columns under ``header``; None cells print as "-"; each
    cell :func:`shown` (a name with a newline or an escape stays one cell)."""
    cells = [[str(h) for h in header]] + [["-" if c is None else shown(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)
