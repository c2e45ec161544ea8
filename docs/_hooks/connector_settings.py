"""A connector's settings table, made from its config model's JSON schema (what ``omni-plugins schema NAME`` prints)."""

from __future__ import annotations

from typing import Any

from omni_plugins.factory import connector_schema, resolve_connector

_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def settings_table(name: str) -> str:
    """A markdown table: one row per field, with its aliases, type and bounds, default and description."""
    schema = connector_schema(name)
    fields = resolve_connector(name).load_config_model().model_fields
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for field, prop in schema["properties"].items():
        info = fields.get(field)
        choices = getattr(info.validation_alias, "choices", None) or [] if info else []
        names = " ".join(f"`{n}`" for n in [field, *(c for c in choices if isinstance(c, str) and c != field)])
        if "default" not in prop and info is not None and not info.is_required():  # a default_factory
            prop = {**prop, "default": info.get_default(call_default_factory=True)}
        sized = "bytes" in field or "size" in field
        cells = (names, _type(prop, schema, sized), _default(prop, sized), _cell(prop.get("description", "")))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _type(prop: dict[str, Any], schema: dict[str, Any], sized: bool) -> str:
    variants = [_resolve(v, schema) for v in prop.get("anyOf", [prop])]
    if any(v.get("pattern") == _BYTE_SIZE_PATTERN for v in variants):  # pydantic's ByteSize: an int or '16MiB'
        ints = [v for v in variants if v.get("type") == "integer"]
        return "size (bytes, or text such as `16MiB`)" + _bounds(ints[0], sized) if ints else "size"
    return " \\| ".join(_one_type(v, sized) for v in variants)


def _resolve(prop: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = prop.get("$ref")
    if not ref:
        return prop
    return schema.get("$defs", {}).get(ref.rsplit("/", 1)[-1], prop)


_BYTE_SIZE_PATTERN = r"^\s*(\d*\.?\d+)\s*(\w+)?"


def _one_type(prop: dict[str, Any], sized: bool) -> str:
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    kind = prop.get("type", "any")
    if prop.get("format") == "password":
        kind = "secret"
    elif prop.get("format") == "path":
        kind = "path"
    elif kind == "array":
        kind = f"list[{_one_type(prop.get('items', {}), sized)}]"
    text = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}.get(kind, kind)
    return text + _bounds(prop, sized)


def _bounds(prop: dict[str, Any], sized: bool) -> str:
    bounds = [
        f"{op} {_number(prop[key], sized)}"
        for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if key in prop
    ]
    if "pattern" in prop:
        bounds.append(f"matching `{prop['pattern'].lstrip('^').rstrip('$')}`")
    if prop.get("minLength"):
        bounds.append("not empty" if prop["minLength"] == 1 else f"length >= {prop['minLength']}")
    return ", " + ", ".join(bounds) if bounds else ""


def _number(value: Any, sized: bool) -> str:
    """``value``, as ``2 MiB`` when it is a whole number of KiB of a size field."""
    if sized and isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        for unit, suffix in _UNITS:
            if value % unit == 0:
                return f"{value // unit} {suffix}"
    return str(value)


def _default(prop: dict[str, Any], sized: bool) -> str:
    if "default" not in prop:
        return "required"
    value = prop["default"]
    if sized and _number(value, sized) != str(value):
        return _number(value, sized)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == [] or value == "":
        return "empty"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Plain text safe inside a table cell: one line, markdown's special characters escaped."""
    text = " ".join(text.split())
    for char in "\\`*[]>|":
        text = text.replace(char, "\\" + char)
    return text.replace("<", "&lt;")  # Markdown has no escape for '<'; the entity keeps it text
