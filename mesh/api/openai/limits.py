"""Size and shape limits on a request's ``tools``, checked before any work that grows with them.

A tool's JSON schema becomes a grammar (:mod:`mesh.api.openai.grammar`) and a prompt, and
both grow with the schema's shape (a ``type`` list is one alternative per entry, an object
one rule per optional property). One walk over the raw ``tools`` value, bounded by
:data:`MAX_SCHEMA_NODES` whatever the body holds, refuses a schema past any limit below with
a :class:`ToolsError` that names the limit and where it was crossed (the API answers 400
``invalid_tools``). Within them the grammar is linear in the schema and a few tens of
milliseconds at most to build; llama.cpp's grammar parser accepts it (it refuses a repeated
group of over 2,000 elements, hence the bound on property names).

The limits admit every tool list of the Berkeley Function Calling Leaderboard (bfcl-eval
2026.3.23, all 3,637 in every category: at most 37 functions, 1,492 nodes, 28 properties in
an object, 68 enum values, JSON nesting 11, no ``type`` lists) with a wide margin; real
schemas are small.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_ENUM",
    "MAX_KEY_CHARS",
    "MAX_PROPERTIES",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "MAX_TOOLS",
    "MAX_TYPE_LIST",
    "ToolsError",
    "check_tools_shape",
]

MAX_TOOLS = 64  # functions in one request
MAX_SCHEMA_NODES = 8192  # JSON values and object keys in all of ``tools`` together
MAX_SCHEMA_DEPTH = 32  # JSON nesting of ``tools`` (the list is level 1)
MAX_PROPERTIES = 64  # properties of one object schema
MAX_TYPE_LIST = 8  # entries of one ``type`` list (JSON Schema has seven types)
MAX_ENUM = 512  # values of one ``enum``
MAX_KEY_CHARS = 256  # characters of one property name


class ToolsError(ValueError):
    """A request's ``tools`` or ``tool_choice`` is malformed or too large (a 400 naming
    ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _over(limit: str, value: int, cap: int, where: str, fix: str) -> ToolsError:
    return ToolsError(f"{where}: {limit} ({value}) is over mesh's limit of {cap}; {fix}",
                      where)


def check_tools_shape(tools: Any) -> None:
    """Refuse ``tools`` past any limit above; O(min(size, MAX_SCHEMA_NODES)) work."""
    if not isinstance(tools, list):
        return  # the request model already refuses a non-list
    if len(tools) > MAX_TOOLS:
        raise _over("the number of tools", len(tools), MAX_TOOLS, "tools",
                    "send fewer tools")
    nodes = 0
    stack: list[tuple[Any, str, int]] = [(tools, "tools", 1)]
    while stack:
        value, where, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _over("the number of schema nodes (JSON values and keys)", nodes,
                        MAX_SCHEMA_NODES, "tools", "send fewer or smaller tool schemas")
        if depth > MAX_SCHEMA_DEPTH:
            raise _over("the schema nesting depth", depth, MAX_SCHEMA_DEPTH, where,
                        "flatten the tool's parameters")
        if isinstance(value, Mapping):
            _check_schema(value, where)
            nodes += len(value)  # the keys
            for key, child in value.items():
                stack.append((child, f"{where}.{str(key)[:40]}", depth + 1))
        elif isinstance(value, list):
            for i, child in enumerate(value):
                stack.append((child, f"{where}[{i}]", depth + 1))


def _check_schema(node: Mapping[str, Any], where: str) -> None:
    """Checks of one mapping read as a schema."""
    kind = node.get("type")
    if isinstance(kind, list) and len(kind) > MAX_TYPE_LIST:
        raise _over("the number of entries in a 'type' list", len(kind), MAX_TYPE_LIST,
                    f"{where}.type", "list each JSON type once")
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_ENUM:
        raise _over("the number of enum values", len(enum), MAX_ENUM, f"{where}.enum",
                    "send fewer values (or a plain string)")
    props = node.get("properties")
    if not isinstance(props, Mapping):
        return
    if len(props) > MAX_PROPERTIES:
        raise _over("the number of properties of one object", len(props), MAX_PROPERTIES,
                    f"{where}.properties", "split the tool or nest its parameters")
    long = next((k for k in props if len(str(k)) > MAX_KEY_CHARS), None)
    if long is not None:
        raise _over("the length of a property name", len(str(long)), MAX_KEY_CHARS,
                    f"{where}.properties", "use shorter names")
