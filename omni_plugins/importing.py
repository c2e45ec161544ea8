"""Resolve ``pkg.mod:attr`` / ``pkg.mod.attr`` import strings."""

from __future__ import annotations

import importlib
from typing import Any


def import_string(path: str) -> Any:
    """Import ``pkg.mod:attr`` (or ``pkg.mod.attr``) and return the attribute.

    Raises ImportError with the path in the message when the module or the
    attribute does not exist.
    """
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    parts = [*module_name.split("."), *attr_path.split(".")]
    if not module_name or not attr_path or not all(p.isidentifier() for p in parts):
        raise ImportError(f"{path!r} is not an import path (expected 'package.module:name')")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no attribute {attr_path!r} (from {path!r})") from None
    return obj
