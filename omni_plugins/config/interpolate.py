"""``${VAR}`` and ``${VAR:-default}`` interpolation in YAML string values."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_PATTERN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}|\$\$")


class MissingVariableError(KeyError):
    """An interpolated variable is not set and has no default."""

    def __init__(self, variable: str) -> None:
        super().__init__(variable)
        self.variable = variable


def interpolate(text: str, env: Mapping[str, str] | None = None) -> str:
    """Replace ``${VAR}`` / ``${VAR:-default}``; ``$$`` is a literal ``$``."""
    source = os.environ if env is None else env

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        value = source.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                raise MissingVariableError(name)
            return default
        return value

    return _PATTERN.sub(sub, text)
