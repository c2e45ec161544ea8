"""Mooncake connectors for omni-plugins.

``mooncake-store`` puts payloads into a ``MooncakeDistributedStore`` (a master
plus the clients' memory segments); ``mooncake-te`` moves them point to point
with a ``TransferEngine`` one-sided read. Nothing here imports ``mooncake``
until a connector is created, so the plugin registers even where the wheel is
missing and the error then says which extra to install.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
