"""omni-plugins connector 'fs-dir': payloads as files in a directory."""

from omni_plugins_fs_dir.config import FsDirConfig
from omni_plugins_fs_dir.connector import FsDirConnector

__all__ = ["FsDirConfig", "FsDirConnector"]
