"""The ``vllm_omni.general_plugins`` entry point: registers ``OmniPlugins`` in vLLM-Omni's connector factory.

vLLM-Omni runs it in every process that builds connectors, possibly more than once per process, and
its factory raises on a duplicate name: so the registration checks
``list_registered_connectors()`` first and registers nothing when the name is taken (by an earlier
call, or by another plugin: then that one keeps it and a warning says so).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from omni_plugins_vllm_omni import CONNECTOR_NAME

log = logging.getLogger(__name__)

_lock = threading.Lock()
_registered = False  # by this process (a forked child inherits its parent's registration and this flag)


def create(config: dict[str, Any]) -> Any:
    """The constructor the factory calls with a connector's ``extra`` (plus the keys it injects)."""
    from omni_plugins_vllm_omni.connector import OmniPluginsConnector

    return OmniPluginsConnector(config)


def register() -> None:
    """Register :data:`CONNECTOR_NAME` unless it is registered already. Safe to call any number of times."""
    global _registered
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    with _lock:
        if CONNECTOR_NAME in OmniConnectorFactory.list_registered_connectors():
            if not _registered:
                log.warning("vLLM-Omni connector name %r is registered by another plugin; omni-plugins did not register it", CONNECTOR_NAME)
            return
        OmniConnectorFactory.register_connector(CONNECTOR_NAME, create)
        _registered = True
