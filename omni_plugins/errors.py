"""Exception hierarchy shared by the core and every plugin.

Everything the framework raises on purpose derives from :class:`OmniPluginsError`,
so callers can catch one type; each subclass says which layer failed.
"""

from __future__ import annotations


class OmniPluginsError(Exception):
    """Base class of every error raised on purpose by omni-plugins."""


class ConfigError(OmniPluginsError, ValueError):
    """A configuration is invalid. The message names file, stage and field when known."""


class ConnectorNotFoundError(OmniPluginsError, LookupError):
    """No connector is registered under the requested name."""


class PluginLoadError(OmniPluginsError, ImportError):
    """A plugin distribution failed to load (raised in strict mode or when chosen)."""


class DuplicateConnectorError(OmniPluginsError):
    """Two distributions register the same canonical connector name."""


class ConnectorClosedError(OmniPluginsError, RuntimeError):
    """A connector was used after ``close()``."""


class ConnectorError(OmniPluginsError, RuntimeError):
    """A backend operation failed (server down, transfer error, corrupt data).

    Backends raise this (or a subclass) with a message naming the server and key.
    """


class TransientConnectorError(ConnectorError):
    """A backend operation failed for a reason that passes; nothing was lost and the same call can succeed later.

    Raised when the reading or writing process runs short of a resource -- file descriptors
    (``EMFILE``), memory or mappings (``ENOMEM``) -- rather than because the data or the backend
    is bad: a ``get`` that raises it left the payload where it was, for a later ``get`` of the
    key. The message names the resource and how to raise it. The runtime retries with backoff
    until the request's deadline instead of failing the request.
    """


class WireFormatError(OmniPluginsError, ValueError):
    """Bytes could not be decoded (or an object could not be encoded) by ``omni_plugins.wire``.

    The only exception :func:`omni_plugins.wire.decode` raises on bad input.
    """


class CorruptPayloadError(WireFormatError, ConnectorError):
    """A stored payload's framing is damaged (a segment header, a slot length, a manifest).

    Raised by a connector's ``get`` after it discarded what it found: retrying
    cannot succeed. It is a :class:`WireFormatError` (callers that treat
    undecodable data as a failed request need no change) and a
    :class:`ConnectorError` (callers that catch backend failures still do).
    """


class ConnectorContractError(OmniPluginsError, TypeError):
    """A connector plugin broke the contract: a primitive returned the wrong type (a plugin bug).

    Not retried: the same code returns the same wrong thing again. The runtime
    reports the request failed at once instead of retrying until its timeout.
    """


class BuilderError(ConfigError):
    """A payload builder cannot be imported or has the wrong signature."""
