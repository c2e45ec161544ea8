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
    # vLLM-Omni's Mooncake connectors: their extra keys, as its YAML files spell them
    for name in ("MooncakeStoreConnector", "MooncakeConnector"):
        registry.register_vllm_omni(
            name,
            connector="mooncake-store",
            keys={
                "host": "local_hostname",
                "master": "master_address",
                "segment": "global_segment_size",
                "localbuf": "local_buffer_size",
                "proto": "protocol",
                "rdma": "device_name",
            },
            description="vLLM-Omni's Mooncake store connector",
        )
    registry.register_vllm_omni(
        "MooncakeTransferEngineConnector",
        connector="mooncake-te",
        keys={"host": "local_hostname", "memory_pool_size": "pool_size", "buffer_ttl_seconds": "payload_ttl"},
        unused={
            "zmq_port": "the control channel listens on listen_address (port 0: any free port); consumers find producers "
            "through rendezvous_dir on one host, metadata_server across hosts",
            "memory_pool_device": "payloads are staged in host memory",
            "sender_host": "consumers find producers themselves (rendezvous_dir, metadata_server, peers)",
            "sender_zmq_port": "consumers find producers themselves (rendezvous_dir, metadata_server, peers)",
            "role": "every instance can produce and consume",
        },
        description="vLLM-Omni's Mooncake Transfer Engine connector",
    )
