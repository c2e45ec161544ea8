"""``${VAR}`` and ``${VAR:-default}`` interpolation in YAML string values.

Also OmegaConf's environment resolver, ``${oc.env:VAR}`` and ``${oc.env:VAR,default}``: vLLM-Omni
loads its deploy files with OmegaConf, so that is how its users write a variable there (OmegaConf
rejects ``${VAR:-default}``). As in OmegaConf, its default applies when the variable is unset (not
when it is empty) and may be quoted (``'a,b'``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

#: ``$$``, a supported reference (OmegaConf's ``oc.env`` form first), or any other ``${`` (malformed: an error
#: rather than text left as it is)
_PATTERN = re.compile(
    r"\$\$"
    r"|\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}"
    r"|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}"
    r"|\$\{"
)

#: how the supported forms are spelled, for error messages
SYNTAX = "${VAR}, ${VAR:-default}, or OmegaConf's ${oc.env:VAR} / ${oc.env:VAR,default} (no nesting; $$ is a literal $)"


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
    """Replace ``${VAR}`` / ``${VAR:-default}`` (and ``${oc.env:VAR}`` / ``${oc.env:VAR,default}``); ``$$`` is a literal ``$``.

    Any other ``${`` raises :class:`MalformedReferenceError`: left in place it would pass for a
    value (``password: ${REDIS_PASSWORD-}`` would be the password ``${REDIS_PASSWORD-}``).
    """
    source = os.environ if env is None else env

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        if match.group(1) is not None and "${" not in (match.group(2) or ""):  # OmegaConf's oc.env: default only when unset
            value = source.get(match.group(1))
            if value is not None:
                return value
            if match.group(2) is None:
                raise MissingVariableError(match.group(1))
            return _unquote(match.group(2).strip())
        name, default = match.group(3), match.group(4)
        if name is None or match.group(1) is not None or (default is not None and "${" in default):
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


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
