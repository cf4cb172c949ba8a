"""A validator for the subset of JSON Schema (2020-12) that docs/strategy.schema.json uses.

jsonschema is not a dependency, so the tests check plan files with this: type, const, enum,
properties, required, additionalProperties, items, minItems, minimum, minLength, pattern,
oneOf, anyOf and local $ref ("#/$defs/..."). A keyword outside that subset is an error, so
the schema cannot silently use something this validator ignores.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

ANNOTATIONS = {"$schema", "$id", "title", "description", "$defs"}
KEYWORDS = {
    "type", "const", "enum", "properties", "required", "additionalProperties", "items",
    "minItems", "minimum", "minLength", "pattern", "oneOf", "anyOf", "$ref",
}  # fmt: skip
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def errors(value: Any, schema: Mapping[str, Any], root: Mapping[str, Any] | None = None,
           path: str = "$") -> Iterator[str]:  # fmt: skip
    """Every way `value` breaks `schema`, as 'path: what' strings (none: valid)."""
    root = root if root is not None else schema
    unknown = set(schema) - KEYWORDS - ANNOTATIONS
    if unknown:
        raise ValueError(f"schema keyword(s) {sorted(unknown)} at {path} are not supported")
    if "$ref" in schema:
        yield from errors(value, _resolve(root, schema["$ref"]), root, path)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(TYPES[t](value) for t in types):
            yield f"{path}: expected {' or '.join(types)}, got {type(value).__name__}"
            return
    if "const" in schema and value != schema["const"]:
        yield f"{path}: expected {schema['const']!r}, got {value!r}"
    if "enum" in schema and value not in schema["enum"]:
        yield f"{path}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, dict):
        yield from _object(value, schema, root, path)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            yield f"{path}: fewer than {schema['minItems']} items"
        if "items" in schema:
            for k, item in enumerate(value):
                yield from errors(item, schema["items"], root, f"{path}[{k}]")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            yield f"{path}: shorter than {schema['minLength']}"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield f"{path}: {value!r} does not match {schema['pattern']!r}"
    if TYPES["number"](value) and "minimum" in schema and value < schema["minimum"]:
        yield f"{path}: {value} < {schema['minimum']}"
    for key, need in (("oneOf", 1), ("anyOf", None)):
        if key in schema:
            passed = sum(not list(errors(value, s, root, path)) for s in schema[key])
            if (need is None and passed == 0) or (need is not None and passed != need):
                yield f"{path}: matches {passed} of the {key} alternatives"


def _object(value: dict[str, Any], schema: Mapping[str, Any], root: Mapping[str, Any],
            path: str) -> Iterator[str]:  # fmt: skip
    for key in schema.get("required", []):
        if key not in value:
            yield f"{path}: missing {key!r}"
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            yield from errors(item, props[key], root, f"{path}.{key}")
        elif extra is False:
            yield f"{path}: unexpected {key!r}"
        elif isinstance(extra, dict):
            yield from errors(item, extra, root, f"{path}.{key}")


def _resolve(root: Mapping[str, Any], ref: str) -> Mapping[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref is supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node  # type: ignore[no-any-return]
