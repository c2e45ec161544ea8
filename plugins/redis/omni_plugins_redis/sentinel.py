"""Which primary the Sentinels name: the newest configuration any of them knows, not the first answer.

Right after a failover only the Sentinel that led it knows the new primary; the
others learn it from that Sentinel's hello messages a few seconds later, and
until then they still name the old primary. If the old primary's process is
back by then (restarted empty, or from an old snapshot) they see it up again
and name it as a healthy primary, until they demote it. redis-py's ``Sentinel``
takes the first answer, so a connection made in that window could read nothing
where the payload is and write where the write will be discarded. Every
failover raises the configuration epoch: :class:`NewestSentinel` asks every
Sentinel and follows the answer with the highest.
"""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.sentinel import MasterNotFoundError, Sentinel


class NewestSentinel(Sentinel):
    """redis-py's ``Sentinel`` whose primary is the one named with the highest ``config-epoch`` among all Sentinels.

    The price is one ``SENTINEL MASTERS`` per Sentinel instead of one in all,
    paid when a connection (re)connects; an unreachable Sentinel delays that by
    its connect timeout.
    """

    def discover_master(self, service_name: str) -> tuple[str, int]:
        newest: dict[str, Any] | None = None
        errors: list[str] = []
        for sentinel in self.sentinels:
            try:
                masters = cast(dict[str, dict[str, Any]], sentinel.sentinel_masters())  # RESP2 (sentinel_for): by name
                state = masters.get(service_name)
            except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError) as exc:
                errors.append(f"{sentinel} - {exc!r}: {exc}")
                continue
            if not state or not self.check_master_state(state, service_name):
                continue
            if newest is None or state["config-epoch"] > newest["config-epoch"]:
                newest = state
        if newest is None:
            raise MasterNotFoundError(f"No master found for {service_name!r}" + (f" : {', '.join(errors)}" if errors else ""))
        ip = self._force_master_ip if self._force_master_ip is not None else newest["ip"]
        return ip, newest["port"]
