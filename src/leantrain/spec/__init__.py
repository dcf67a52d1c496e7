"""The job spec: schema, loading (profiles, overrides, env interpolation) and model shapes."""

from leantrain.spec.load import load_spec, parse_override, resolve_secret, spec_from_dict
from leantrain.spec.schema import JobSpec
from leantrain.spec.shapes import ModelShape, resolve_shape

__all__ = [
    "JobSpec",
    "ModelShape",
    "load_spec",
    "parse_override",
    "resolve_secret",
    "resolve_shape",
    "spec_from_dict",
]
