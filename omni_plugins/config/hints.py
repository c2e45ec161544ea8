"""Hints for misspelled fields: the closest known name, and the names a settings model accepts."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from omni_plugins.config.yamldoc import Loc


def close_match(name: str, candidates: list[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ''."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def model_field_names(model: Any, path: Loc = ()) -> list[str]:
    """Field names (and alias choices) of a pydantic ``model`` at ``path``, descending into nested models."""
    for p in path:
        field = getattr(model, "model_fields", {}).get(p) if isinstance(p, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    names: list[str] = []
    for name, field in getattr(model, "model_fields", {}).items():
        choices = getattr(field.validation_alias, "choices", None) or [field.validation_alias or field.alias]
        names += [name, *(c for c in choices if isinstance(c, str) and c != name)]
    return names
