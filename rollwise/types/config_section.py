"""The base of every section of the run config (rollwise.config, and the task, prompt and reward sections
their own packages define): what a value must be before any field's own bounds are checked.

- no unknown keys (a typo fails with the key named);
- numbers are finite: NaN and +-Infinity (YAML `.nan`, `.inf`, `1e999`) are refused in every float field,
  tuples and lists of floats included, so no bound (`gt=0`, `le=1`) is ever compared against a NaN;
- true/false is not a number: pydantic's lax mode reads `lr: true` as 1.0 and `steps: true` as 1; a
  field that takes a number refuses a boolean (or a list holding one), fields that take bool are unchanged.

Lax mode stays on otherwise, on purpose: PyYAML reads `1e-5` (no dot) as the string "1e-5", and pydantic
turns that string into the float the user meant.
"""

from __future__ import annotations

import json
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def takes_bool(annotation: object) -> bool:
    """Whether a field's annotation admits true/false anywhere in it (bool, Any, Literal[True], or a container
    of them)."""
    if annotation is bool or annotation is Any or isinstance(annotation, bool):
        return True
    return any(takes_bool(arg) for arg in get_args(annotation))


def holds_bool(value: object) -> bool:
    """A boolean, or a list/tuple with one inside (however nested)."""
    if isinstance(value, bool):
        return True
    return isinstance(value, (list, tuple)) and any(holds_bool(item) for item in value)


class ConfigSection(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: object, info: ValidationInfo) -> object:
        # Only fields that take no bool: `tensorboard: true` passes, `lr: true` is refused.
        if info.field_name is not None and holds_bool(value) and not takes_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"got {json.dumps(value, default=str)}: true/false is not a value of this field "
                             "(it takes a number or text)")
        return value
