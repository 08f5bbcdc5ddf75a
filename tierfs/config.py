"""Configuration machinery shared by every daemon and the client.

A config is a frozen dataclass whose fields carry a ``doc`` in their
metadata. :func:`load` builds one with the precedence
flags > environment (``TIERFS_<SECTION>_<FIELD>``) > TOML file > defaults,
converts strings to the field's type (sizes accept ``4MiB``, durations accept
``500ms``), and calls the class's ``validate()``; every problem is a
:class:`~tierfs.errors.ConfigError` naming the field.

Each role defines its own class (``tierfs.meta.config.MetaConfig``, ...)
by subclassing :class:`BaseConfig` and setting ``SECTION``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

from tierfs.errors import ConfigError

__all__ = ["BaseConfig", "field", "load", "parse_duration", "parse_size"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40,
    "p": 1000**5, "pb": 1000**5, "pib": 1 << 50, "pi": 1 << 50,
    "e": 1000**6, "eb": 1000**6, "eib": 1 << 60, "ei": 1 << 60,
}
_DUR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DUR_UNITS = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}


def parse_size(value: str | int) -> int:
    """``"4MiB"`` -> 4194304; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m or (m.group(2) or "").lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 4096, 4MiB, 1GB)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


def parse_duration(value: str | float | int) -> float:
    """``"500ms"`` -> 0.5; plain numbers are seconds."""
    if isinstance(value, int | float):
        return float(value)
    m = _DUR_RE.match(value)
    if not m:
        raise ValueError(f"not a duration: {value!r} (examples: 1.5, 500ms, 2s, 1m)")
    return float(m.group(1)) * _DUR_UNITS[m.group(2)]


def field(default: Any, doc: str, *, kind: str = "", **kw: Any) -> Any:
    """A documented config field. ``kind`` is "size" or "duration" to accept
    human units; lists and dicts get a copied default."""
    md = {"doc": doc, "kind": kind}
    if isinstance(default, list | dict):
        factory: Any = functools.partial(copy.deepcopy, default)
        return dataclasses.field(default_factory=factory, metadata=md, **kw)
    return dataclasses.field(default=default, metadata=md, **kw)


@dataclasses.dataclass(frozen=True)
class BaseConfig:
    """Subclasses set SECTION (the TOML table and env prefix) and add fields."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Cross-field rules; raise ConfigError(reason, field=name)."""

    @classmethod
    def docs(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _convert(cls: type[BaseConfig], f: dataclasses.Field[Any], raw: Any) -> Any:
    hints = typing.get_type_hints(cls)
    tp = hints[f.name]
    kind = f.metadata.get("kind", "")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none")):
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    try:
        if kind == "size":
            return parse_size(raw)
        if kind == "duration":
            return parse_duration(raw)
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if tp is int:
            if isinstance(raw, bool):
                raise ValueError(f"not an integer: {raw!r}")
            return int(raw)
        if tp is float:
            return float(raw)
        if tp is str:
            if not isinstance(raw, str):
                raise ValueError(f"not a string: {raw!r}")
            return raw
        if tp is Path:
            return Path(raw)
        if origin in (list, tuple):
            items = [s.strip() for s in raw.split(",") if s.strip()] if isinstance(raw, str) else list(raw)
            inner = args[0] if args else str
            conv = [inner(x) for x in items]
            return conv if origin is list else tuple(conv)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc), field=f.name) from None
    return raw


#: The tables a config file may hold (one per role; a client reads the
#: top level).
ROLE_TABLES = ("meta", "storage", "client")


def load(
    cls: type[BaseConfig],
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """Build ``cls`` from defaults < TOML ``path`` < env < ``overrides`` (flags).

    Unknown keys in the TOML table or in ``overrides`` are errors (a typo must
    not be silently ignored). ``None`` values in ``overrides`` mean "flag not
    given" and are skipped.
    """
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            doc = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}", field="config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: {exc}", field="config") from None
        table = doc.get(cls.SECTION, doc) if cls.SECTION else doc
        if not isinstance(table, dict):
            raise ConfigError(f"[{cls.SECTION}] must be a table", field="config")
        tables = [k for k, v in doc.items() if isinstance(v, dict) and k not in fields]
        odd = [k for k in tables if k not in ROLE_TABLES and k != cls.SECTION]
        if odd:
            # A misspelled [meta] made a daemon ignore its whole file and
            # start on defaults (a fresh one-replica cluster, until stop 47).
            raise ConfigError(f"{p}: unknown table [{odd[0]}] (a config file's tables are "
                              f"{', '.join(f'[{t}]' for t in ROLE_TABLES)})", field="config")
        if cls.SECTION and cls.SECTION not in doc and tables \
                and not any(not isinstance(v, dict) or k in fields for k, v in doc.items()):
            raise ConfigError(f"{p} has no [{cls.SECTION}] table (only {', '.join(f'[{t}]' for t in tables)})",
                              field="config")
        for k, v in table.items():
            if isinstance(v, dict) and k != cls.SECTION and k not in fields:
                continue  # another role's table in a shared file
            if k not in fields:
                raise ConfigError(f"unknown key in {p}", field=k)
            values[k] = _convert(cls, fields[k], v)
    prefix = f"TIERFS_{cls.SECTION.upper()}_" if cls.SECTION else "TIERFS_"
    for name, f in fields.items():
        key = prefix + name.upper()
        if key in env:
            values[name] = _convert(cls, f, env[key])
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in fields:
            raise ConfigError("unknown option", field=k)
        values[k] = _convert(cls, fields[k], v)
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc), field="config") from None
