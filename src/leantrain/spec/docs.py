"""Generate docs/spec.md from the pydantic models, so the reference can never drift from the code.

Regenerate with `make docs` (python -m leantrain.spec.docs > docs/spec.md); a test compares the file.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from leantrain.spec.load import PROFILE_ALLOWED_PREFIXES
from leantrain.spec.schema import JobSpec

HEADER = """# Job spec reference

Generated from the spec models (`src/leantrain/spec/schema.py`, `data_schema.py`) by `make docs`; a test keeps
this file in sync.

A job spec is one YAML file. Unknown keys are errors. Loading order: YAML (duplicate keys refused; at most 64
levels deep and 200,000 nodes counting every use of an alias, else exit 2 naming the line; each alias becomes its
own copy, and a cyclic alias like `&s [*s]` is refused) → refuse literal secrets →
`--profile NAME` overlay (scale and resources only) → `--set a.b=c` overrides → `${VAR}` / `${VAR:-default}`
interpolation (the default when VAR is unset or empty, as in the shell; secret-named keys keep the reference;
it is read from the environment only when used) →
validation, including the cross-field rules at the end of this page. Relative paths resolve against the
spec file's folder.
"""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "(section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "**required**"
    return f"`{field.default}`" if field.default is not None else "`null`"


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _section_models(arg)]


def _render_model(model: type[BaseModel], path: str, out: list[str]) -> None:
    doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
    out += [f"## `{path}`" if path else "## top level", "", doc, "",
            "| field | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        for sub in _section_models(field.annotation):
            nested.append((f"{path}.{name}" if path else name, sub))
    out.append("")
    for sub_path, sub in nested:
        _render_model(sub, sub_path, out)


CROSS_FIELD_RULES = """## Cross-field rules

- `data_parallel × tensor_parallel × pipeline_parallel` equals `hardware.num_nodes × gpus_per_node` (or
  `budget.num_gpus`) when either is given.
- `expert_parallel` and `data_parallel_replicate` divide `data_parallel`; `expert_parallel` divides
  `model.moe.num_experts` and needs `architecture: moe`.
- `tensor_parallel` divides `n_heads`, `n_kv_heads` and `ffn_hidden`; `pipeline_parallel × virtual_stages`
  is at most `n_layers`; `virtual_stages > 1` needs `pipeline_schedule: interleaved_1f1b`.
- `model.moe.top_k ≤ num_experts`; `d_model` divisible by `n_heads`; `n_heads` by `n_kv_heads`.
- `training.global_batch_tokens` is a multiple of `micro_batch × seq_len × data_parallel`.
- `hardware.num_nodes` lies within `fault.min_nodes .. fault.max_nodes` when those are given.
- Keys named like secrets (`secret`, `password`, `token`, `access_key`, `secret_key`, `api_key`,
  `private_key`, `encryption_key`, `credentials`, or ending in `_token`, `_password`, ...) must be
  `${{VAR}}` references.
- A profile (`profiles.NAME`, chosen with `--profile NAME`) changes only scale and resources; the paths
  it may set: {allowed}.
"""


def render_spec_markdown() -> str:
    out = [HEADER]
    _render_model(JobSpec, "", out)
    out.append(CROSS_FIELD_RULES.format(allowed=", ".join(f"`{p}`" for p in PROFILE_ALLOWED_PREFIXES)))
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render_spec_markdown(), end="")
