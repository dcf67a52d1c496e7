"""The job spec: loading, broken specs, secrets, profiles, overrides, env interpolation, fuzzing."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leantrain.errors import SpecError, UserInputError
from leantrain.spec import load_spec, resolve_secret, spec_from_dict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# The minimal 10B job file: the core of examples/seed-10b.yaml in flow style (no hardware, budget or secrets).
SEED_YAML = """
task: pretrain
model: {size_billion: 10, architecture: dense}
parallelism: {data_parallel: 8, tensor_parallel: 2, pipeline_parallel: 4, expert_parallel: 1}
precision: {compute: bf16, optimizer_state: 8bit}
data: {tokens_total: 2e12, seq_len: 4096}
checkpoint: {interval_steps: 1000, keep_last: 5, storage: object_store}
fault: {auto_restart: true, elasticity: true}
"""

TINY = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 192, "vocab_size": 512},
    "data": {"tokens_total": 1e5, "seq_len": 128},
    "training": {"global_batch_tokens": 1024, "micro_batch": 4},
    "parallelism": {"data_parallel": 1},
}


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def with_change(path: str, value: object) -> dict:
    raw = copy.deepcopy(TINY)
    node = raw
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return raw


def test_seed_yaml_loads_as_written(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, SEED_YAML))
    assert spec.model.size_billion == 10
    assert spec.data.tokens_total == 2e12  # YAML reads "2e12" as a string; the spec makes it a number
    assert spec.parallelism.world_size == 64
    assert spec.precision.optimizer_state == "8bit"
    assert spec.checkpoint.storage == "object_store"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_parses(name: str, tmp_path: Path) -> None:
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    overrides = []
    if (raw.get("model") or {}).get("init_from"):  # the CPU fine-tuning examples start from a model built on demand
        from leantrain.model.tiny_hf import save_example_model

        save_example_model(tmp_path / "tiny-llama")
        overrides.append(f"model.init_from={tmp_path / 'tiny-llama'}")
    spec = load_spec(EXAMPLES / name, overrides=overrides)
    assert spec.model is not None


def test_examples_cover_the_required_set() -> None:
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {"tiny-cpu.yaml", "seed-10b.yaml", "llama3-8b-h100.yaml", "moe-small-cpu.yaml",
            "gpu-1b-bench.yaml"} <= names


# (name, change to TINY, text that the error must contain: the field path)
BROKEN = [
    ("unknown top-level key", ("trainning", {"lr": 1}), "trainning"),
    ("unknown nested key", ("training.learning_rate", 0.1), "training.learning_rate"),
    ("bad architecture", ("model.architecture", "sparse"), "model.architecture"),
    ("negative lr", ("training.lr", -1.0), "training.lr"),
    ("zero seq_len", ("data.seq_len", 0), "data.seq_len"),
    ("tokens not a number", ("data.tokens_total", "lots"), "data.tokens_total"),
    ("unknown accelerator", ("hardware.accelerator", "TPU-v9"), "hardware.accelerator"),
    ("bad precision", ("precision.compute", "fp4"), "precision.compute"),
    ("bad optimizer state", ("precision.optimizer_state", "4bit"), "precision.optimizer_state"),
    ("tp does not divide heads", ("parallelism.tensor_parallel", 3), "tensor_parallel"),
    ("ep without moe", ("parallelism.expert_parallel", 2), "expert_parallel"),
    ("zero stage 4", ("parallelism.zero_stage", 4), "parallelism.zero_stage"),
    ("mfu above one", ("budget.assumed_mfu", 1.5), "budget.assumed_mfu"),
    ("spare too large", ("budget.spare_fraction", 0.9), "budget.spare_fraction"),
    ("keep_last zero", ("checkpoint.keep_last", 0), "checkpoint.keep_last"),
    ("interval word", ("checkpoint.interval_steps", "sometimes"), "checkpoint.interval_steps"),
    ("bad storage", ("checkpoint.storage", "tape"), "checkpoint.storage"),
    ("object store url not s3", ("checkpoint", {"storage": "object_store", "url": "http://x"}), "checkpoint"),
    ("global batch not a multiple", ("training.global_batch_tokens", 1000), "global_batch_tokens"),
    ("product mismatches gpus", ("hardware", {"accelerator": "cpu", "num_nodes": 2, "gpus_per_node": 1}),
     "num_nodes"),
    ("pp beyond layers", ("parallelism.pipeline_parallel", 4), "pipeline_parallel"),
    ("prometheus port", ("monitoring.prometheus_port", 70000), "monitoring.prometheus_port"),
    ("bad schedule", ("training.schedule", "linear-ish"), "training.schedule"),
    ("model without size or shape", ("model", {"architecture": "dense"}), "size_billion"),
    ("kv heads do not divide heads", ("model.n_kv_heads", 3), "n_kv_heads"),
    ("elastic bounds reversed", ("fault", {"min_nodes": 4, "max_nodes": 2}), "max_nodes"),
]


@pytest.mark.parametrize(("name", "change", "needle"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_specs_name_the_field(name: str, change: tuple[str, object], needle: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_from_dict(with_change(*change))
    assert needle in str(info.value)


def test_moe_rules() -> None:
    raw = copy.deepcopy(TINY)
    raw["model"]["architecture"] = "moe"
    raw["model"]["moe"] = {"num_experts": 4, "top_k": 6}
    with pytest.raises(SpecError, match="top_k"):
        spec_from_dict(raw)
    raw["model"]["moe"] = {"num_experts": 6, "top_k": 2}
    raw["parallelism"] = {"data_parallel": 4, "expert_parallel": 4}
    raw["training"]["global_batch_tokens"] = 4096
    with pytest.raises(SpecError, match="num_experts"):
        spec_from_dict(raw)


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"line \d+, column \d+: YAML syntax error"):
        load_spec(write(tmp_path, "task: pretrain\nmodel: [size_billion: 1\ndata: {}\n"))


def test_duplicate_keys_are_refused_with_both_lines(tmp_path: Path) -> None:
    text = yaml.safe_dump(TINY, sort_keys=False) + "training:\n  lr: 1.0e-3\n"  # a second `training:` section
    first = 1 + text.splitlines().index("training:")
    with pytest.raises(SpecError) as raised:
        load_spec(write(tmp_path, text))
    assert f"duplicate key 'training' at lines {first} and {len(text.splitlines()) - 1}" in str(raised.value)
    nested = "model: {n_layers: 2, d_model: 64, n_layers: 4}\n"
    with pytest.raises(SpecError, match="duplicate key 'n_layers' at lines 1 and 1"):
        load_spec(write(tmp_path, nested, "nested.yaml"))
    merged = "base: &b {seq_len: 128}\ndata:\n  <<: *b\n  tokens_total: 1.0e+5\n"  # YAML's own overlay: fine
    with pytest.raises(SpecError) as raised:
        load_spec(write(tmp_path, merged, "merge.yaml"))
    assert "duplicate key" not in str(raised.value)


@pytest.mark.parametrize(("path", "value", "needle"), [
    ("training.max_steps", 10**29, "training.max_steps"),
    ("training.max_steps", 1e29, "training.max_steps"),
    ("training.warmup_steps", 10**12, "training.warmup_steps"),
    ("training.seed", 2**64, "training.seed"),
    ("checkpoint.keep_last", 10**20, "checkpoint.keep_last"),
    ("data.seq_len", 2**60, "data.seq_len"),
    ("monitoring.prometheus_port", 70000, "monitoring.prometheus_port"),
])
def test_integers_out_of_range_are_refused_naming_the_field(path: str, value: object, needle: str) -> None:
    with pytest.raises(SpecError) as raised:
        spec_from_dict(with_change(path, value))
    assert needle in str(raised.value)


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


def test_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="mapping"):
        load_spec(write(tmp_path, "- a\n- b\n"))


def test_literal_secret_refused_and_reference_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def spec_text(key: str) -> str:
        extra = f"storage: object_store, url: 's3://b/p', access_key: {key}}}"
        return SEED_YAML.replace("storage: object_store}", extra)

    with pytest.raises(SpecError, match=r"checkpoint.access_key: a literal secret.*\$\{VAR\}"):
        load_spec(write(tmp_path, spec_text("AKIAIOSFODNN7EXAMPLE")))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    spec = load_spec(write(tmp_path, spec_text("'${AWS_ACCESS_KEY_ID}'")))
    assert spec.checkpoint.access_key == "${AWS_ACCESS_KEY_ID}"  # kept as a reference, never the value
    with pytest.raises(UserInputError, match="AWS_ACCESS_KEY_ID"):
        resolve_secret(spec.checkpoint.access_key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    assert resolve_secret(spec.checkpoint.access_key) == "AKIAIOSFODNN7EXAMPLE"
    assert "AKIAIOSFODNN7EXAMPLE" not in spec.model_dump_json()


@pytest.mark.parametrize("key", ["password", "api_key", "webhook_token", "secret", "private_key"])
def test_secret_like_keys_anywhere_are_refused(key: str) -> None:
    raw = with_change(f"monitoring.{key}", "hunter2")
    with pytest.raises(SpecError, match=f"monitoring.{key}: a literal secret"):
        spec_from_dict(raw)


def test_token_counts_are_not_secrets() -> None:
    spec = spec_from_dict(with_change("data.tokens_total", 5e5))
    assert spec.data.tokens_total == 5e5


def test_env_interpolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LT_SEQ", "256")
    monkeypatch.setenv("LT_RUN", "/tmp/somewhere")
    raw = with_change("data.seq_len", "${LT_SEQ}")
    raw["run"] = {"dir": "${LT_RUN}/run-${LT_MISSING:-a}"}
    raw["training"]["global_batch_tokens"] = 2048
    spec = spec_from_dict(raw)
    assert spec.data.seq_len == 256
    assert str(spec.run.dir) == "/tmp/somewhere/run-a"
    # Empty is unset for a default, as in the shell: a pod whose Secret was templated from an unset variable
    # holds "", and `${VAR:-default}` lost its default there (a whole-value reference loaded as null).
    monkeypatch.setenv("LT_EMPTY", "")
    raw["run"] = {"dir": "${LT_EMPTY:-/tmp/default}", "name": "x${LT_EMPTY}y"}
    spec = spec_from_dict(raw)
    assert str(spec.run.dir) == "/tmp/default" and spec.run.name == "xy"


def test_env_interpolation_missing_names_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LT_NOT_SET", raising=False)
    with pytest.raises(SpecError, match=r"data.seq_len: environment variable LT_NOT_SET is not set"):
        spec_from_dict(with_change("data.seq_len", "${LT_NOT_SET}"))


def test_overrides_are_typed_and_validated() -> None:
    spec = spec_from_dict(TINY, overrides=["training.lr=1e-4", "training.schedule=wsd", "model.tie_embeddings=true"])
    assert spec.training.lr == pytest.approx(1e-4)
    assert spec.training.schedule == "wsd"
    assert spec.model.tie_embeddings is True
    with pytest.raises(SpecError, match="training.lrr"):
        spec_from_dict(TINY, overrides=["training.lrr=1"])
    with pytest.raises(UserInputError, match="key.path=value"):
        spec_from_dict(TINY, overrides=["training.lr"])
    with pytest.raises(SpecError, match="literal secret"):
        spec_from_dict(TINY, overrides=["checkpoint.secret_key=abc"])


def test_override_into_list() -> None:
    raw = copy.deepcopy(TINY)
    raw["data"]["sources"] = [{"name": "a", "path": "a.jsonl"}, {"name": "b", "path": "b.jsonl"}]
    spec = spec_from_dict(raw, overrides=["data.sources.1.weight=3"])
    assert spec.data.sources[1].weight == 3
    with pytest.raises(UserInputError, match="not an index"):
        spec_from_dict(raw, overrides=["data.sources.5.weight=3"])


def test_relative_paths_resolve_against_spec_folder(tmp_path: Path) -> None:
    raw = copy.deepcopy(TINY)
    raw["data"]["sources"] = [{"name": "a", "path": "corpus/a.jsonl"}]
    raw["data"]["dir"] = "prepared"
    sub = tmp_path / "jobs"
    sub.mkdir()
    spec = load_spec(write(sub, yaml.safe_dump(raw)))
    assert spec.data.sources[0].path == sub / "corpus/a.jsonl"
    assert spec.data.dir == sub / "prepared"


def test_profiles_change_scale_only(tmp_path: Path) -> None:
    raw = copy.deepcopy(TINY)
    raw["profiles"] = {
        "dev": {"data": {"tokens_total": 1000}, "training": {"max_steps": 3}},
        "bad": {"model": {"n_layers": 4}},
    }
    path = write(tmp_path, yaml.safe_dump(raw))
    base = load_spec(path)
    dev = load_spec(path, profile="dev")
    assert (base.data.tokens_total, dev.data.tokens_total) == (1e5, 1000)
    assert dev.training.max_steps == 3
    assert dev.model == base.model
    with pytest.raises(SpecError, match=r"profiles.bad.model.n_layers: a profile may change only scale"):
        load_spec(path, profile="bad")
    with pytest.raises(SpecError, match=r"--profile 'prod': no such profile \(profiles: bad, dev\)"):
        load_spec(path, profile="prod")


def test_seed_example_rehearsal_profile() -> None:
    spec = load_spec(EXAMPLES / "seed-10b.yaml", profile="rehearsal")
    assert spec.hardware.num_gpus == 32
    assert spec.parallelism.world_size == 32


# A fuzz: arbitrary values in every leaf of the tiny spec must give a SpecError/UserInputError or a
# valid spec — never another exception (a traceback for the user).
LEAVES = [
    "model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads", "model.vocab_size",
    "model.architecture", "model.size_billion", "data.tokens_total", "data.seq_len", "training.lr",
    "training.micro_batch", "training.global_batch_tokens", "parallelism.data_parallel",
    "parallelism.tensor_parallel", "parallelism.pipeline_parallel", "parallelism.expert_parallel",
    "checkpoint.interval_steps", "hardware.accelerator", "budget.assumed_mfu", "fault.min_nodes",
    "precision.compute", "run.dir", "data.sources", "model.moe",
]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10**12, max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.lists(st.tuples(st.sampled_from(LEAVES), VALUES), min_size=1, max_size=4))
def test_fuzzed_specs_never_traceback(changes: list[tuple[str, object]]) -> None:
    raw = copy.deepcopy(TINY)
    for path, value in changes:
        node = raw
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    try:
        spec_from_dict(raw)
    except (SpecError, UserInputError) as err:
        assert str(err)


def test_a_dumped_spec_reloads() -> None:
    """Tokenizer special tokens (eos_token) are not secrets, so a full dump round-trips."""
    spec = spec_from_dict(TINY)
    again = spec_from_dict(spec.model_dump(mode="json"))
    assert again == spec


def _laughs(levels: int = 9) -> str:
    """The "billion laughs" alias bomb: 9 levels of 9 aliases each expand to 9^9 ≈ 3.9 × 10^8 leaves."""
    lines = ['lol0: &lol0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nmodel: *lol{levels}\n"


YAML_BOMBS = {
    "deep_flow": ("model: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than 64 levels"),
    "deep_mapping": ("model: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n", "nested deeper than 64 levels"),
    "deep_block": ("".join(" " * i + "a:\n" for i in range(2_000)), "nested deeper than 64 levels"),
    "self_alias": ("model: &s [*s]\n", "alias *s refers to a node that contains it"),
    "billion_laughs": (_laughs(), "expands to more than 200,000 nodes"),
    "deep_by_alias": ("".join(f"a{i}: &a{i} [{f'*a{i - 1}' if i else 1}]\n" for i in range(100)),
                      "alias *a"),
}


@pytest.mark.parametrize("name", sorted(YAML_BOMBS))
def test_yaml_bombs_exit_2_naming_the_line(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from leantrain.cli import main

    text, needle = YAML_BOMBS[name]
    assert main(["check", str(write(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert needle in err and "line " in err and "Traceback" not in err


def test_deep_yaml_bomb_through_the_real_entry_point(tmp_path: Path) -> None:
    import subprocess
    import sys

    text, needle = YAML_BOMBS["deep_flow"]
    out = subprocess.run([sys.executable, "-m", "leantrain.cli", "check", str(write(tmp_path, text))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr + out.stdout


def test_aliases_are_resolved_once_into_a_plain_tree(tmp_path: Path) -> None:
    """A `--set` into one use of an alias leaves the other use alone; anchors and merge keys still work."""
    from leantrain.spec.yaml_load import load_yaml_text

    tree = load_yaml_text("a: &x {k: 1}\nb: *x\nc: {<<: *x, j: 2}\n")
    assert tree == {"a": {"k": 1}, "b": {"k": 1}, "c": {"k": 1, "j": 2}}
    assert tree["a"] is not tree["b"]
    text = yaml.safe_dump(TINY, sort_keys=False) + "profiles:\n  a: &p {training: {max_steps: 3}}\n  b: *p\n"
    spec = load_spec(write(tmp_path, text), overrides=["profiles.a.training.max_steps=5"])
    assert spec.profiles["a"]["training"]["max_steps"] == 5
    assert spec.profiles["b"]["training"]["max_steps"] == 3


def test_a_cyclic_or_too_deep_mapping_from_code_is_refused() -> None:
    raw = copy.deepcopy(TINY)
    raw["model"]["loop"] = raw["model"]
    with pytest.raises(SpecError, match="contains itself"):
        spec_from_dict(raw)
    deep: dict = {}
    node = deep
    for _ in range(5_000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(SpecError, match="nested deeper than 64 levels"):
        spec_from_dict({**TINY, "model": deep})


def test_override_value_bomb_is_refused() -> None:
    with pytest.raises(UserInputError, match="--set model.x: .*nested deeper"):
        spec_from_dict(TINY, overrides=["model.x=" + "[" * 10_000])


def test_a_negative_curriculum_weight_is_refused_naming_it() -> None:
    """It passed the spec and `prepare`, then `train` failed inside numpy ("repeats may not contain negative
    values")."""
    raw = copy.deepcopy(TINY)
    raw["data"]["stages"] = [{"weights": {"en": -1.0, "zh": 2.0}}]
    with pytest.raises(SpecError, match=r"data\.stages\.0\.weights\.en"):
        spec_from_dict(raw)
