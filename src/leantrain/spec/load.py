"""Loading a job spec: YAML → secret check → profile overlay → --set overrides → ${ENV} → validation.

Secret-keyed values are never interpolated here: the spec keeps the `${VAR}` reference and
`resolve_secret` reads the environment at the moment of use, so a secret never sits in a parsed spec,
a plan.json or a log.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from leantrain.errors import SpecError, UserInputError
from leantrain.spec.schema import SECRET_REF_RE, JobSpec
from leantrain.spec.yaml_load import YamlLimitError, as_tree, describe_yaml_error, load_yaml_text

ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
SECRET_KEY_RE = re.compile(
    r"(^|_)(secret|secrets|password|passwd|token|access_key|secret_key|api_key|private_key|encryption_key|credentials?)$",
    re.IGNORECASE,
)
# Profiles change scale and resources only: a job's environments differ in data scale and resources, nothing else.
PROFILE_ALLOWED_PREFIXES = (
    "data.tokens_total", "data.dir", "data.sources", "data.replicas",
    "hardware", "budget", "parallelism", "fault", "monitoring", "run", "checkpoint", "cluster",
    "precision.compute",
    "training.max_steps", "training.micro_batch", "training.global_batch_tokens", "training.device",
    "training.compile", "training.log_every", "training.activation_checkpointing", "training.warmup_steps",
)


# Tokenizer special tokens end in "_token" but are vocabulary entries, not credentials.
NOT_SECRET_KEY_RE = re.compile(r"^(eos|bos|pad|unk|sep|cls|mask)_token$", re.IGNORECASE)


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY_RE.search(key)) and not NOT_SECRET_KEY_RE.match(key)


def _walk(node: Any, path: str = ""):
    """Yield (dotted path, key, value) for every mapping entry, depth first."""
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            yield sub, str(key), value
            yield from _walk(value, sub)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}.{i}" if path else str(i))


def literal_secret_problems(raw: dict[str, Any]) -> list[str]:
    """Secret-named keys whose value is not a `${VAR}` reference."""
    problems = []
    for path, key, value in _walk(raw):
        is_literal = value is not None and not isinstance(value, dict | list)
        is_reference = isinstance(value, str) and SECRET_REF_RE.match(value)
        if is_secret_key(key) and is_literal and not is_reference:
            problems.append(
                f"{path}: a literal secret is not allowed in a spec file; put it in an environment "
                f"variable and write `{key}: ${{VAR}}` (e.g. ${{{key.upper()}}})"
            )
    return problems


def _interpolate(node: Any, path: str, problems: list[str]) -> Any:
    if isinstance(node, dict):
        return {
            k: v if is_secret_key(str(k)) else _interpolate(v, f"{path}.{k}" if path else str(k), problems)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_interpolate(v, f"{path}.{i}", problems) for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if default is not None and not value:  # as the shell's ${VAR:-default}: unset or empty (a job file's
            return default                       # Secret templated from an unset variable holds "")
        if value is None:
            problems.append(f"{path}: environment variable {name} is not set (or write ${{{name}:-default}})")
            return match.group(0)
        return value

    replaced = ENV_RE.sub(replace, node)
    if ENV_RE.fullmatch(node.strip()) and replaced != node:
        # A whole-value reference takes the type YAML would give the text (numbers stay numbers).
        try:
            return load_yaml_text(replaced)
        except YamlLimitError as err:
            problems.append(f"{path}: the value of {node.strip()} {describe_yaml_error(err)}")
            return replaced
        except yaml.YAMLError:
            return replaced
    return replaced


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserInputError(f"--set {dotted}: {where} is not an index of a list of {len(node)}")
            node = node[int(part)]
        elif isinstance(node, dict):
            if not isinstance(node.get(part), dict | list):
                node[part] = {}
            node = node[part]
        else:
            raise UserInputError(f"--set {dotted}: {where} is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise UserInputError(f"--set {dotted}: {last} is not an index of a list of {len(node)}")
        node[int(last)] = value
    else:
        node[last] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` → ("a.b", c) with c typed as YAML would type it."""
    if "=" not in text:
        raise UserInputError(f"--set {text!r}: expected key.path=value")
    key, _, raw_value = text.partition("=")
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise UserInputError(f"--set {text!r}: the key path {key!r} is empty or has an empty part")
    try:
        value = load_yaml_text(raw_value) if raw_value.strip() else ""
    except YamlLimitError as err:
        raise UserInputError(f"--set {key}: {describe_yaml_error(err)}") from None
    except yaml.YAMLError:
        value = raw_value
    return key, value


def _deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _leaf_paths(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in _leaf_paths(v, f"{path}.{k}" if path else str(k))]
    return [path]


def apply_profile(raw: dict[str, Any], name: str | None) -> dict[str, Any]:
    """Overlay the named profile; refuse one that changes anything but scale and resources."""
    profiles = raw.get("profiles") or {}
    if name is None:
        return raw
    if not isinstance(profiles, dict) or name not in profiles:
        known = ", ".join(sorted(profiles)) if isinstance(profiles, dict) and profiles else "none defined"
        raise SpecError([f"--profile {name!r}: no such profile (profiles: {known})"])
    overlay = profiles[name]
    if not isinstance(overlay, dict):
        raise SpecError([f"profiles.{name}: must be a mapping of spec fields, got {type(overlay).__name__}"])
    bad = [
        p for p in _leaf_paths(overlay)
        if not any(p == a or p.startswith(a + ".") for a in PROFILE_ALLOWED_PREFIXES)
    ]
    if bad:
        raise SpecError([
            f"profiles.{name}.{p}: a profile may change only scale and resources "
            f"(allowed: {', '.join(PROFILE_ALLOWED_PREFIXES)})"
            for p in bad
        ])
    return _deep_merge(raw, overlay)


def _fields_at(parts: list[str]) -> list[str]:
    """The field names of the spec section at `parts` (a location inside JobSpec); [] when not a section."""
    from pydantic import BaseModel

    model: Any = JobSpec
    for part in parts:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        model = field.annotation
        candidates = [a for a in getattr(model, "__args__", ()) if isinstance(a, type)] or [model]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


def _unknown_field(parts: list[str]) -> str:
    """`unknown field`, with the closest field names ("did you mean `warmup_steps`?") or the allowed ones."""
    import difflib

    allowed = _fields_at(parts[:-1])
    close = difflib.get_close_matches(parts[-1], allowed, n=1, cutoff=0.6)
    if close:
        return "unknown field; did you mean " + " or ".join(f"`{c}`" for c in close) + "?"
    return "unknown field" + (f" (allowed: {', '.join(allowed)})" if allowed else "")


def _override_for(loc: str, overrides: list[str]) -> str | None:
    for text in overrides:
        key = text.partition("=")[0].strip()
        if loc == key or loc.startswith(key + ".") or key.startswith(loc + "."):
            return text
    return None


def format_validation_error(err: ValidationError, *, overrides: list[str] | None = None) -> list[str]:
    """One line per problem: the field, what is wrong (with a suggestion for a typo), the value, and the
    `--set` override that set it, when one did."""
    lines = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if p not in ("function-after",)]
        loc = ".".join(parts)
        msg = _unknown_field(parts) if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        value = e.get("input")
        shown = "" if isinstance(value, dict | list) or value is None else f" (got {value!r})"
        source = _override_for(loc, overrides or []) if loc else None
        lines.append(f"{loc or 'spec'}: {msg}{shown}" + (f" — from --set {source}" if source else ""))
    return lines


def _resolve_paths(spec: JobSpec, base_dir: Path) -> JobSpec:
    def resolve(p: Path | None) -> Path | None:
        if p is None or isinstance(p, str):  # a str is an object-store URL (data.sources[].path)
            return p
        p = p.expanduser()
        return p if p.is_absolute() else (base_dir / p)

    spec.data.dir = resolve(spec.data.dir)  # type: ignore[assignment]
    for source in spec.data.sources:
        source.path = resolve(source.path)  # type: ignore[assignment]
    spec.data.tokenizer.path = resolve(spec.data.tokenizer.path)
    spec.run.dir = resolve(spec.run.dir)  # type: ignore[assignment]
    spec.run.registry = resolve(spec.run.registry)
    spec.monitoring.alert_rules = resolve(spec.monitoring.alert_rules)
    if spec.checkpoint.storage == "local" and spec.checkpoint.url:
        spec.checkpoint.url = str(resolve(Path(spec.checkpoint.url)))
    return spec


def spec_from_dict(
    raw: Any,
    *,
    source: str = "<spec>",
    base_dir: Path | None = None,
    profile: str | None = None,
    overrides: list[str] | None = None,
) -> JobSpec:
    """Validate a raw mapping as a job spec (the whole loading pipeline after YAML parsing)."""
    if not isinstance(raw, dict):
        raise SpecError([f"the file must hold a mapping of sections, got {type(raw).__name__}"], source=source)
    try:
        raw = as_tree(raw)  # a mapping built in code meets the file's bounds; no node shared by two places
    except YamlLimitError as err:
        raise SpecError([describe_yaml_error(err)], source=source) from None
    problems = literal_secret_problems(raw)
    if problems:
        raise SpecError(problems, source=source)
    try:
        merged = apply_profile(copy.deepcopy(raw), profile)  # never mutate the caller's mapping
    except SpecError as err:
        raise SpecError(err.problems, source=source) from None
    for text in overrides or []:
        key, value = parse_override(text)
        _set_path(merged, key, value)
    problems = literal_secret_problems(merged)
    if problems:
        raise SpecError(problems, source=source)
    env_problems: list[str] = []
    merged = _interpolate(merged, "", env_problems)
    if env_problems:
        raise SpecError(env_problems, source=source)
    _resolve_init_from(merged, base_dir or Path.cwd())
    try:
        spec = JobSpec.model_validate(merged)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, overrides=overrides), source=source) from None
    return _resolve_paths(spec, base_dir or Path.cwd())


def _resolve_init_from(merged: dict[str, Any], base_dir: Path) -> None:
    """model.init_from is read while the spec validates (its config.json gives the shape), so it is made
    relative to the spec file before validation, not after like the other paths."""
    model = merged.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_from"), str):
        path = Path(model["init_from"]).expanduser()
        model["init_from"] = str(path if path.is_absolute() else base_dir / path)


def load_spec(path: str | Path, *, profile: str | None = None, overrides: list[str] | None = None) -> JobSpec:
    """Load and validate a YAML job spec file."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"spec file {path} does not exist or is not a file")
    try:
        raw = load_yaml_text(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise SpecError([f"not UTF-8 text ({err.reason} at byte {err.start})"], source=str(path)) from None
    except yaml.YAMLError as err:
        raise SpecError([describe_yaml_error(err)], source=str(path)) from None
    return spec_from_dict(
        raw, source=str(path), base_dir=path.resolve().parent, profile=profile, overrides=overrides
    )


def resolve_secret(ref: str | None) -> str | None:
    """Read a `${VAR}` secret reference from the environment at the moment of use."""
    if ref is None:
        return None
    match = SECRET_REF_RE.match(ref)
    if not match:
        raise UserInputError("secret values must be environment references like ${VAR}")
    name = ref[2:-1]
    value = os.environ.get(name)
    if value is None:
        raise UserInputError(f"environment variable {name} (a secret the spec refers to) is not set")
    return value
