"""A JSON Schema (draft-07) validator for the keywords the Compose file
schema uses (tests/data/compose-spec.json): ``type``, ``enum``,
``properties``, ``patternProperties``, ``additionalProperties``,
``required``, ``items``, ``uniqueItems``, ``oneOf``, ``anyOf``, ``allOf``,
``not``, ``minimum``, ``maximum``, ``pattern``, ``minItems``, ``maxItems``
and local ``$ref`` (``#/definitions/...``). The core test venv has no
``jsonschema`` package; a keyword this module does not know makes
:func:`validate` raise rather than pass silently, so a newer schema cannot
validate less than it says.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SchemaError", "validate"]

_IGNORED = {"$schema", "$id", "id", "title", "description", "default", "deprecated", "examples", "$comment",
            "definitions", "format"}
_KNOWN = _IGNORED | {"type", "enum", "const", "properties", "patternProperties", "additionalProperties", "required",
                     "items", "uniqueItems", "oneOf", "anyOf", "allOf", "not", "minimum", "maximum", "pattern",
                     "minItems", "maxItems", "minProperties", "maxProperties", "$ref"}


class SchemaError(Exception):
    """The schema uses a keyword this validator does not implement."""


def _is_type(v: Any, t: str) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "null":
        return v is None
    raise SchemaError(f"unknown type {t!r}")


def _errors(v: Any, s: Any, root: dict[str, Any], path: str) -> list[str]:
    if s is True or s == {}:
        return []
    if s is False:
        return [f"{path}: not allowed"]
    unknown = set(s) - _KNOWN
    if unknown:
        raise SchemaError(f"schema keyword(s) {sorted(unknown)} at {path} are not implemented")
    if "$ref" in s:
        ref = s["$ref"]
        if not ref.startswith("#/"):
            raise SchemaError(f"non-local $ref {ref!r}")
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        return _errors(v, target, root, path)
    out: list[str] = []
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is_type(v, t) for t in types):
            return [f"{path}: {type(v).__name__} {v!r:.60} is not of type {'/'.join(types)}"]
    if "enum" in s and v not in s["enum"]:
        out.append(f"{path}: {v!r} is not one of {s['enum']}")
    if "const" in s and v != s["const"]:
        out.append(f"{path}: {v!r} is not {s['const']!r}")
    if isinstance(v, str) and "pattern" in s and not re.search(s["pattern"], v):
        out.append(f"{path}: {v!r} does not match {s['pattern']!r}")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"]:
            out.append(f"{path}: {v} < minimum {s['minimum']}")
        if "maximum" in s and v > s["maximum"]:
            out.append(f"{path}: {v} > maximum {s['maximum']}")
    if isinstance(v, dict):
        for k in s.get("required", []):
            if k not in v:
                out.append(f"{path}: required property {k!r} missing")
        if len(v) < s.get("minProperties", 0) or len(v) > s.get("maxProperties", len(v)):
            out.append(f"{path}: {len(v)} properties")
        props, pats = s.get("properties", {}), s.get("patternProperties", {})
        for k, item in v.items():
            sub = f"{path}.{k}"
            matched = False
            if k in props:
                matched = True
                out += _errors(item, props[k], root, sub)
            for pat, ps in pats.items():
                if re.search(pat, str(k)):
                    matched = True
                    out += _errors(item, ps, root, sub)
            if not matched and "additionalProperties" in s:
                out += _errors(item, s["additionalProperties"], root, sub)
    if isinstance(v, list):
        if "items" in s:
            items = s["items"]
            if isinstance(items, list):
                for i, (item, ps) in enumerate(zip(v, items, strict=False)):
                    out += _errors(item, ps, root, f"{path}[{i}]")
            else:
                for i, item in enumerate(v):
                    out += _errors(item, items, root, f"{path}[{i}]")
        if s.get("uniqueItems"):
            seen = [repr(x) for x in v]
            if len(set(seen)) != len(seen):
                out.append(f"{path}: items are not unique")
        if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", len(v)):
            out.append(f"{path}: {len(v)} items")
    for kw in ("allOf", "anyOf", "oneOf"):
        if kw not in s:
            continue
        results = [_errors(v, sub, root, path) for sub in s[kw]]
        passed = sum(not r for r in results)
        if kw == "allOf":
            out += [e for r in results for e in r]
        elif kw == "anyOf" and not passed:
            out.append(f"{path}: matches none of anyOf ({'; '.join(r[0] for r in results)})")
        elif kw == "oneOf" and passed != 1:
            why = "; ".join(r[0] for r in results if r) or "more than one matches"
            out.append(f"{path}: matches {passed} of oneOf, not exactly one ({why})")
    if "not" in s and not _errors(v, s["not"], root, path):
        out.append(f"{path}: matches a schema it must not")
    return out


def validate(instance: Any, schema: dict[str, Any]) -> list[str]:
    """Every way ``instance`` violates ``schema`` ([] when it conforms)."""
    return _errors(instance, schema, schema, "$")
