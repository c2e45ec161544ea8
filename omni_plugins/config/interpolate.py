"""``${VAR}`` and ``${VAR:-default}`` interpolation in YAML string values."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

#: ``$$``, a supported reference, or any other ``${`` (malformed: an error rather than text left as it is)
_PATTERN = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\{")

#: how the supported forms are spelled, for error messages
SYNTAX = "${VAR} or ${VAR:-default} (no nesting; $$ is a literal $)"


class MissingVariableError(KeyError):
    """An interpolated variable is not set and has no default."""

    def __init__(self, variable: str) -> None:
        super().__init__(variable)
        self.variable = variable


class MalformedReferenceError(ValueError):
    """A ``${`` that starts no supported reference (``${VAR-}``, ``${VAR:x}``, ``${VAR``, nesting)."""

    def __init__(self, reference: str) -> None:
        super().__init__(f"malformed reference {reference!r}: use {SYNTAX}")
        self.reference = reference


def interpolate(text: str, env: Mapping[str, str] | None = None) -> str:
    """Replace ``${VAR}`` / ``${VAR:-default}``; ``$$`` is a literal ``$``.

    Any other ``${`` raises :class:`MalformedReferenceError`: left in place it would pass for a
    value (``password: ${REDIS_PASSWORD-}`` would be the password ``${REDIS_PASSWORD-}``).
    """
    source = os.environ if env is None else env

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name is None or (default is not None and "${" in default):
            end = text.find("}", match.start())
            reference = text[match.start() : end + 1 if end >= 0 else len(text)]
            raise MalformedReferenceError(reference if len(reference) <= 60 else reference[:57] + "...")
        value = source.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                raise MissingVariableError(name)
            return default
        return value

    return _PATTERN.sub(sub, text)
