"""The tiered model cache's settings (rollwise.pool.model_cache), apart from it: the CLI builds them without
importing torch."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class CacheSettings(BaseModel):
    """`rollwise serve pool --cache-memory-gib/--cache-dir/--cache-disk-gib`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_bytes: int = Field(0, ge=0)  # 0: no memory tier
    disk_dir: Path | None = None  # None: no disk tier
    disk_bytes: int = Field(0, ge=0)
