"""JSON bodies as the guard reads them: parsing with a depth bound, and field checks.

Every check raises :class:`Invalid` with a message that names the field and the fix; the
caller maps ``Invalid.kind`` to its surface's error (a JSON-RPC code or an HTTP status).
Fields are read by their JSON (camelCase) or proto (snake_case) name, as protobuf accepts
both.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["Invalid", "boolean", "check_json_depth", "field", "integer", "obj", "parse_json",
           "str_list", "string", "type_name"]


class Invalid(Exception):
    """A client mistake; ``kind`` picks the error code, the message names the fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # parse | request | method | params | version


def check_json_depth(value: Any, max_depth: int) -> None:
    """Raise ``Invalid('parse')`` if ``value`` nests deeper than ``max_depth`` (iterative)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > max_depth:
                raise Invalid("parse", f"JSON nests deeper than {max_depth} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def parse_json(body: bytes, max_depth: int) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Invalid("parse", f"body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise Invalid("parse", "body is empty; send a JSON object")
    # Cheap pre-scan: brackets bound the nesting depth, so a shallow body skips the walk
    # and a hostile one is refused before json.loads recurses into it.
    if text.count("[") + text.count("{") > max_depth and _bracket_depth(text) > max_depth:
        raise Invalid("parse", f"JSON nests deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise Invalid("parse", f"JSON nests deeper than {max_depth} levels") from None
    except ValueError as e:
        raise Invalid("parse", f"body is not valid JSON: {e}") from None


def _bracket_depth(text: str) -> int:
    """Max nesting of [ and { outside JSON strings."""
    depth = best = 0
    for ch in _BRACKETS.sub("", _STRINGS.sub("", text)):
        if ch in "[{":
            depth += 1
            best = max(best, depth)
        else:
            depth -= 1
    return best


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[^\[\]{}]+")


def field(obj: dict[str, Any], camel: str) -> Any:
    """A field by its JSON name or its proto name (protobuf accepts both)."""
    if camel in obj:
        return obj[camel]
    snake = re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()
    return obj.get(snake)


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def string(obj: dict[str, Any], key: str, at: str, *, required: bool = False) -> str | None:
    value = field(obj, key)
    if value is None:
        if required:
            raise Invalid("params", f"{at}.{key} is required (a string)")
        return None
    if not isinstance(value, str):
        raise Invalid("params", f"{at}.{key} must be a string, got {type_name(value)}")
    if required and not value:
        raise Invalid("params", f"{at}.{key} must not be empty")
    return value


def integer(obj: dict[str, Any], key: str, at: str, lo: int, hi: int | None = None) -> None:
    value = field(obj, key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid("params", f"{at}.{key} must be an integer, got {type_name(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise Invalid("params", f"{at}.{key} must be {bound}, got {value}")


def boolean(obj: dict[str, Any], key: str, at: str) -> None:
    value = field(obj, key)
    if value is not None and not isinstance(value, bool):
        raise Invalid("params", f"{at}.{key} must be true or false, got {type_name(value)}")


def obj(
    obj: dict[str, Any], key: str, at: str, *, required: bool = False
) -> dict[str, Any] | None:
    value = field(obj, key)
    if value is None:
        if required:
            raise Invalid("params", f"{at}.{key} is required (an object)")
        return None
    if not isinstance(value, dict):
        raise Invalid("params", f"{at}.{key} must be an object, got {type_name(value)}")
    return value


def str_list(obj: dict[str, Any], key: str, at: str) -> None:
    value = field(obj, key)
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Invalid("params", f"{at}.{key} must be a list of strings")
