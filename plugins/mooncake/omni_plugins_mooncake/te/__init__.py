"""``mooncake-te``: point-to-point transfers with a Mooncake ``TransferEngine``.

- :mod:`.pool`: the producer's table of staged payloads (claim, release, TTL reclaim).
- :mod:`.control`: the "where is key K" channel (length-prefixed msgpack over TCP, authenticated with a shared secret).
- :mod:`.discovery`: optional same-host directory of producers (and of their generated secrets).
- :mod:`.connector`: the connector that composes them with the engine.
"""
