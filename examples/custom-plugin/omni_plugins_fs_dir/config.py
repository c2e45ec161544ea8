"""Settings of the 'fs-dir' connector (validated from a stage's ``extra`` mapping)."""

from __future__ import annotations

import os
import tempfile

from pydantic import Field

from omni_plugins.settings import ConnectorSettings


class FsDirConfig(ConnectorSettings):
    """Producers and consumers must use the same ``directory`` to see each other."""

    directory: str = Field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), "omni-fs-dir"),
        min_length=1,
        description="where payload files live (created with mode 0700 if missing)",
    )
    poll_interval: float = Field(default=0.002, gt=0, le=1.0, description="first sleep of a waiting get (doubles up to 50 ms)")
    max_payload_bytes: int = Field(default=1 << 34, gt=0, description="largest payload a get will read")
