"""Moved: Sample lives in the types layer (rollwise.types.sample), below every package that reads it.

Kept so importers outside rollout/ keep working; new code imports rollwise.types.
"""

from rollwise.types.sample import Sample, group_samples

__all__ = ["Sample", "group_samples"]
