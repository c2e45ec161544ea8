"""Redis and Redis Cluster connector for omni-plugins.

Install with ``pip install omni-plugins-redis``; then
``create_connector("redis", {"url": "redis://127.0.0.1:6379/0"})``.
"""

from omni_plugins_redis.config import RedisConfig

__all__ = ["RedisConfig"]
