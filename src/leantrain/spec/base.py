"""Shared building blocks of the job spec's pydantic models."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

SECRET_REF_RE = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*\}$")

# No count, size or step in a spec is larger (2**53: every integer up to it is exact as a JSON/float number);
# fields with a tighter meaning (ports, steps) carry their own bound.
MAX_SPEC_INT = 2**53
MAX_STEPS = 10**9  # optimizer steps: a billion is beyond any run (Llama 3 405B: on the order of a million)
PositiveInt = Annotated[int, Field(gt=0, le=MAX_SPEC_INT)]
Fraction = Annotated[float, Field(gt=0, le=1)]


class Section(BaseModel):
    """Base for every spec section: unknown keys are errors, so a typo never silently does nothing; integers
    beyond MAX_SPEC_INT (e.g. `max_steps: 1e29`) and non-finite numbers (`.inf`, `.nan`: no field means them; the
    planner's arithmetic overflowed on them) are refused, naming the field."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_integers(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SPEC_INT:
            raise ValueError(f"{value:.3g} is out of range (at most 2**53 = {MAX_SPEC_INT:,})")
        return value


SecretRef = Annotated[
    str,
    Field(pattern=SECRET_REF_RE.pattern, description="an environment reference `${VAR}`, never the secret"),
]
