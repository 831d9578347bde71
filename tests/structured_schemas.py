"""Twenty JSON schemas of increasing difficulty, shared by the engine and server tests.

Every string is bounded (maxLength, enum, or a pattern of bounded length) and every array has
maxItems, so even a random model's output is finite: the grammar must still close it.
"""

from __future__ import annotations

from typing import Any

SHORT = {"type": "string", "maxLength": 6}
SMALL_INT = {"type": "integer", "minimum": -20, "maximum": 20}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"enum": ["red", "green", "blue"]},
    {"type": "string", "maxLength": 8},
    {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    {"type": "integer", "minimum": -50, "maximum": 1000},
    {"enum": [1, "two", None, True]},
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    _object({"ok": {"type": "boolean"}}),
    _object({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _object({"kind": {"const": "point"}, "color": {"enum": ["red", "green"]}}),
    _object({"outer": _object({"inner": _object({"value": SMALL_INT})})}),
    {
        "type": "array",
        "items": _object({"id": SMALL_INT, "tag": SHORT}),
        "minItems": 1,
        "maxItems": 3,
    },
    {"anyOf": [SMALL_INT, SHORT, {"type": "null"}]},
    _object({"value": {"anyOf": [{"type": "boolean"}, _object({"n": SMALL_INT})]}}),
    _object({"a": SHORT, "b": SMALL_INT, "c": {"type": "boolean"}}, required=["a"]),
    {
        "$defs": {"pair": _object({"x": SMALL_INT, "y": SMALL_INT})},
        "type": "array",
        "items": {"$ref": "#/$defs/pair"},
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "array",
        "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "minItems": 1,
        "maxItems": 2,
    },
    _object(
        {
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,3}$"},
            "tags": {
                "type": "array",
                "items": {"enum": ["x", "y", "z"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "size": {"type": "integer", "minimum": 1, "maximum": 5},
        }
    ),
    _object(
        {
            "user": _object({"name": SHORT, "role": {"enum": ["admin", "guest"]}}),
            "items": {
                "type": "array",
                "items": _object(
                    {
                        "sku": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
                "minItems": 1,
                "maxItems": 2,
            },
            "note": {"anyOf": [SHORT, {"type": "null"}]},
            "priority": {"enum": [1, 2, 3]},
        },
        required=["user", "items", "priority"],
    ),
]
assert len(SCHEMAS) == 20
