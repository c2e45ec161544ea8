"""Backend services: what a plugin offers for its connector besides the connector.

A plugin declares them next to the connector (``registry.register(..., services="pkg.mod:Class")``);
the class derives from :class:`ConnectorServices` and overrides what its backend offers:

- ``census`` / ``reclaim``: what one run left in the backend, and freeing it (``omni-plugins run``);
- ``start_server`` / ``server_environment`` / ``server_variables``: a private server on a free
  loopback port (``run --start-servers``, ``bench``, the ``omni_server`` pytest fixture);
- ``bench_config`` / ``raw_baseline``: the connector config and the raw baseline ``omni-plugins bench``
  measures the connector against (:class:`RawBaseline` says what it measures);
- ``preload``: modules the fork server of stage processes imports once.

See docs/plugin-services.md.
"""

from omni_plugins.services._base import SERVICE_ATTRIBUTES, SERVICE_METHODS, ConnectorServices, offered
from omni_plugins.services._lookup import load_services, preload_modules, registered_services, require, services_for
from omni_plugins.services._types import Finding, PrivateServer, RawBaseline, RunScope, ServiceUnavailable

__all__ = [
    "SERVICE_ATTRIBUTES",
    "SERVICE_METHODS",
    "ConnectorServices",
    "Finding",
    "PrivateServer",
    "RawBaseline",
    "RunScope",
    "ServiceUnavailable",
    "load_services",
    "offered",
    "preload_modules",
    "registered_services",
    "require",
    "services_for",
]
