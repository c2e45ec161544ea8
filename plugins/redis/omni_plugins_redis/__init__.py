"""Redis, Redis Cluster and Redis Sentinel connector for omni-plugins, on redis-py.

Install with ``pip install omni-plugins-redis``; then
``create_connector("redis", {"url": "redis://127.0.0.1:6379/0"})``.
"""

from omni_plugins_redis.config import RedisConfig

__all__ = ["RedisConfig"]
