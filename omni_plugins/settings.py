"""Base class for connector config models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConnectorSettings(BaseModel):
    """Base for every connector's config model: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
