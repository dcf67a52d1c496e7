"""docs/spec.md is generated from the spec models and must match them."""

from __future__ import annotations

from pathlib import Path

from leantrain.spec.docs import render_spec_markdown
from leantrain.spec.schema import JobSpec

DOC = Path(__file__).resolve().parents[1] / "docs" / "spec.md"


def test_spec_reference_is_in_sync() -> None:
    assert DOC.read_text(encoding="utf-8") == render_spec_markdown(), "run `make docs` to regenerate docs/spec.md"


def test_every_field_has_a_description() -> None:
    def walk(model: type, path: str) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{path}{name}")
        return missing

    from leantrain.spec import schema

    sections = [obj for obj in vars(schema).values()
                if isinstance(obj, type) and issubclass(obj, schema.Section) and obj is not schema.Section]
    missing = [m for cls in sections for m in walk(cls, f"{cls.__name__}.")]
    assert not missing, missing
    assert JobSpec in sections
