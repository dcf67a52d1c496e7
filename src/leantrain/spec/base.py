"""Shared building blocks of the job spec's pydantic models."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

SECRET_REF_RE = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*\}$")

PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]


class Section(BaseModel):
    """Base for every spec section: unknown keys are errors, so a typo never silently does nothing."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


SecretRef = Annotated[
    str,
    Field(pattern=SECRET_REF_RE.pattern, description="an environment reference `${VAR}`, never the secret"),
]
