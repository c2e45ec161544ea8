"""Entry point (group ``omni_plugins``): registers ``mooncake-store`` and ``mooncake-te``.

Only import strings here: ``mooncake`` is imported when a connector is created.
"""

from __future__ import annotations

from omni_plugins import RegistrationSink, hookimpl


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        "mooncake-store",
        connector="omni_plugins_mooncake.store:MooncakeStoreConnector",
        config="omni_plugins_mooncake.config:MooncakeStoreConfig",
        aliases=["MooncakeStoreConnector", "MooncakeConnector"],
        description="Mooncake distributed store (mooncake_master + client segments), TCP or RDMA",
        services="omni_plugins_mooncake.services:StoreServices",
    )
    registry.register(
        "mooncake-te",
        connector="omni_plugins_mooncake.te.connector:MooncakeTransferEngineConnector",
        config="omni_plugins_mooncake.config:MooncakeTEConfig",
        aliases=["MooncakeTransferEngineConnector"],
        description="Mooncake Transfer Engine point to point (one-sided reads, P2PHANDSHAKE), TCP or RDMA",
        services="omni_plugins_mooncake.services:TEServices",
    )
