"""Import ``mooncake`` lazily, turning a failure into an error that says what to install."""

from __future__ import annotations

import ctypes.util
import importlib
from types import ModuleType

from omni_plugins.errors import PluginLoadError

_EXTRAS_HINT = (
    "install the Mooncake wheel for this machine: pip install 'omni-plugins-mooncake[cpu]' "
    "(no GPU: mooncake-transfer-engine-non-cuda), '[cuda]' (CUDA 12) or '[cuda13]'"
)


class MooncakeUnavailableError(PluginLoadError):
    """The ``mooncake`` module (or a native library it needs) cannot be loaded."""


def explain_import_failure(module: str, exc: BaseException) -> str:
    """A one-paragraph diagnosis of why ``module`` failed to import, naming the fix."""
    text = str(exc)
    parts = [f"cannot import {module!r} ({type(exc).__name__}: {text})."]
    if "libibverbs" in text or ctypes.util.find_library("ibverbs") is None:
        parts.append("Mooncake needs libibverbs.so.1 even for TCP; on Debian/Ubuntu: apt-get install -y libibverbs1.")
    if "libcuda" in text or "libcudart" in text:
        parts.append(
            "The CUDA build of Mooncake is installed on a machine without CUDA: "
            "pip uninstall -y mooncake-transfer-engine && pip install 'omni-plugins-mooncake[cpu]'."
        )
    elif isinstance(exc, ModuleNotFoundError) and exc.name in {"mooncake", module}:
        parts.append(_EXTRAS_HINT[0].upper() + _EXTRAS_HINT[1:] + ".")
    else:
        parts.append("If the wheel does not match this machine, " + _EXTRAS_HINT + ".")
    return " ".join(parts)


def import_mooncake(module: str) -> ModuleType:
    """Import ``mooncake.store`` or ``mooncake.engine``; raise :class:`MooncakeUnavailableError` with the fix."""
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as exc:
        raise MooncakeUnavailableError(explain_import_failure(module, exc)) from exc
