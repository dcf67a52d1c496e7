"""`leantrain plan` end to end: the seed example, plan.json's contract keys, what-if, an impossible job,
the checkpoint interval, storage and the search's speed."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import pytest
from rich.console import Console

from leantrain.errors import UserInputError
from leantrain.plan.budget import DEFAULT_FAILURES_PER_GPU_DAY, checkpoint_bytes, daly_interval_s
from leantrain.plan.command import parse_what_if, run
from leantrain.plan.inputs import plan_inputs
from leantrain.plan.planner import build_plan, make_plan
from leantrain.plan.search import search_layouts
from leantrain.spec import load_spec, spec_from_dict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONTRACT_KEYS = [
    "compute.flops_per_token", "compute.total_flops", "resources.num_gpus", "resources.num_gpus_with_spare",
    "time.days", "time.gpu_hours", "cost.total", "cost.per_million_tokens",
    *(f"memory.per_gpu.{k}" for k in ("params", "grads", "optimizer", "activations", "buffers", "total")),
    "memory.fits", *(f"layout.{k}" for k in ("dp", "tp", "pp", "ep", "micro_batch", "recompute", "zero")),
    "throughput.tokens_per_s", "throughput.mfu", "storage.data_bytes", "storage.checkpoint_bytes",
    "checkpoint.interval_steps", "checkpoint.interval_s", "checkpoint.save_s", "alternatives",
]


def lookup(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


def console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, color_system=None), buf


def test_seed_example() -> None:
    """10B params, 2T tokens → 1.2e23 FLOPs; 4e14 FLOP/s per GPU for 30 days → 116 GPUs before spare."""
    plan = make_plan(load_spec(EXAMPLES / "seed-10b.yaml"))
    assert plan["compute"]["total_flops"] == pytest.approx(1.2e23)
    assert plan["compute"]["sizing"] == "6ND"
    assert plan["resources"]["num_gpus_exact"] == pytest.approx(1.2e23 / (4e14 * 30 * 86400))
    assert plan["resources"]["num_gpus"] == 116
    assert plan["resources"]["num_gpus_with_spare"] == math.ceil(116 * 1.08)
    assert plan["time"]["days"] == pytest.approx(30 * 115.7407 / 116, rel=1e-4)
    assert plan["cost"]["total"] == pytest.approx(plan["time"]["gpu_hours"] * 2.5)
    # The detailed count (output layer + attention) is larger and only drives MFU, never the GPU count.
    assert plan["compute"]["model_total_flops"] > plan["compute"]["total_flops"]
    assert plan["memory"]["fits"]
    assert plan["layout"]["dp"] * plan["layout"]["tp"] * plan["layout"]["pp"] == plan["resources"]["layout_gpus"]


def test_detailed_sizing_needs_more_gpus() -> None:
    spec = load_spec(EXAMPLES / "seed-10b.yaml", overrides=["budget.sizing_flops=detailed"])
    assert make_plan(spec)["resources"]["num_gpus"] > 116


def test_cli_writes_every_contract_key(tmp_path: Path) -> None:
    out, buf = console()
    json_path = tmp_path / "plan.json"
    png = tmp_path / "what-if.png"
    run(console=out, spec=load_spec(EXAMPLES / "seed-10b.yaml"), json_out=json_path, top=3,
        what_if=f"gpus=64,128,plot={png}")
    data = json.loads(json_path.read_text())
    missing = [k for k in CONTRACT_KEYS if _missing(data, k)]
    assert not missing, missing
    assert data["alternatives"] and data["alternatives"][0]["fits"]
    text = buf.getvalue()
    for needle in ("budget", "memory per GPU", "layouts on 120 GPUs", "storage and checkpoints", "what if"):
        assert needle in text
    assert [row["gpus"] for row in data["what_if"]] == [64, 128]
    assert data["what_if"][0]["days"] == pytest.approx(2 * data["what_if"][1]["days"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _missing(data: dict, key: str) -> bool:
    try:
        lookup(data, key)
    except (KeyError, TypeError):
        return True
    return False


def test_what_if_parsing() -> None:
    assert parse_what_if("gpus=64,128,256") == ([64, 128, 256], None)
    assert parse_what_if("gpus=8,plot=a.png") == ([8], Path("a.png"))
    assert parse_what_if("gpus=8,plot=a.jpg") == ([8], Path("a.jpg"))  # any format matplotlib writes
    for bad in ("gpus=", "gpus=x", "nodes=4", ""):
        with pytest.raises(UserInputError):
            parse_what_if(bad)
    # A bare count said "unknown key None"; a second plot= silently replaced the first.
    for bad, named in (("64,128", "start with a key"), ("gpus=8,plot=a.png,plot=b.png", "more than once")):
        with pytest.raises(UserInputError, match=named):
            parse_what_if(bad)


def impossible_spec():
    return spec_from_dict({"model": {"size_billion": 405}, "data": {"tokens_total": 15e12, "seq_len": 8192},
                           "training": {"global_batch_tokens": 16 * 2**20},
                           "hardware": {"accelerator": "H100-SXM", "num_nodes": 1},
                           "budget": {"target_days": None, "num_gpus": 8}})


def test_impossible_spec_says_what_would_fit() -> None:
    out, buf = console()
    run(console=out, spec=impossible_spec(), json_out=None, top=3, what_if=None)
    text = buf.getvalue()
    assert "does not fit" in text
    assert "more GPUs:" in text and "GiB per GPU" in text
    plan = build_plan(impossible_spec())
    assert not plan.fits
    more = next(line for line in plan.search.suggestions if line.startswith("more GPUs"))
    needed = int(more.split()[2])
    assert needed > 8 and search_layouts(plan.inputs, needed, suggest=False).best is not None
    assert search_layouts(plan.inputs, needed - 8, suggest=False).best is None


def test_405b_on_16384_gpus_searches_in_under_two_seconds() -> None:
    spec = spec_from_dict({"model": {"n_layers": 126, "d_model": 16384, "n_heads": 128, "n_kv_heads": 8,
                                     "ffn_hidden": 53248}, "data": {"tokens_total": 15.6e12, "seq_len": 8192},
                           "training": {"global_batch_tokens": 16 * 2**20}, "hardware": {"accelerator": "H100"}})
    inputs = plan_inputs(spec)
    start = time.perf_counter()
    result = search_layouts(inputs, 16384)
    assert time.perf_counter() - start < 2.0
    best = result.best
    assert best is not None and best.memory.fits and best.layout.num_gpus == 16384
    assert any("sequences of the global batch" in why for why in result.rejected)


def test_checkpoint_interval_young_daly() -> None:
    spec = load_spec(EXAMPLES / "seed-10b.yaml", overrides=["checkpoint.interval_steps=auto"])
    plan = make_plan(spec)
    ck, gpus = plan["checkpoint"], plan["resources"]["layout_gpus"]
    inputs = plan_inputs(spec)
    nodes = math.ceil(gpus / spec.hardware.gpus_per_node)
    save_s = checkpoint_bytes(inputs) / (1e9 * nodes)  # 1 GB/s per node writing in parallel (the default)
    mtbf_s = 86400 / (DEFAULT_FAILURES_PER_GPU_DAY * gpus)
    assert pytest.approx(419 / (54 * 16384)) == DEFAULT_FAILURES_PER_GPU_DAY
    assert ck["save_s"] == pytest.approx(save_s)
    assert ck["mtbf_s"] == pytest.approx(mtbf_s)
    assert ck["young_interval_s"] == pytest.approx(math.sqrt(2 * save_s * mtbf_s))
    assert ck["recommended_interval_s"] == pytest.approx(daly_interval_s(blocking_s=save_s, mtbf_s=mtbf_s))
    assert ck["recommended_interval_s"] == pytest.approx(ck["young_interval_s"], rel=0.02)  # δ ≪ M here
    assert ck["interval_steps"] == round(ck["recommended_interval_s"] / plan["throughput"]["step_s"])
    assert 0.9 < ck["expected_goodput"] < 1.0


def test_storage_bytes() -> None:
    plan = make_plan(load_spec(EXAMPLES / "seed-10b.yaml"))
    s = plan["storage"]
    assert s["tokenized_bytes"] == 2e12 * 4  # vocab 128,256 does not fit uint16
    assert s["data_bytes"] == 2e12 * 4 + 2e12 * 4.0
    params = plan["model"]["total_params"]
    assert s["checkpoint_bytes"] == pytest.approx(params * (4 + 2 * (1 + 4 / 256)))  # fp32 weights, 8-bit moments
    assert s["checkpoints_kept_bytes"] == pytest.approx(5 * s["checkpoint_bytes"])


def test_fixed_gpu_count_reports_days_and_uses_the_spec_layout() -> None:
    plan = make_plan(load_spec(EXAMPLES / "llama3-8b-h100.yaml"))
    assert plan["resources"]["num_gpus"] == 64
    assert plan["layout"]["source"] == "spec" and plan["layout"]["dp"] == 64
    assert plan["time"]["days"] == pytest.approx(6 * 8e9 * 15e12 / (64 * 989.5e12 * 0.4 * 86400), rel=0.02)


def test_moe_plan_counts_active_params(tmp_path: Path) -> None:
    plan = make_plan(load_spec(EXAMPLES / "moe-small-cpu.yaml"))
    assert plan["model"]["active_params"] < plan["model"]["total_params"]
    assert plan["memory"]["fits"]


def test_demo_stage(tmp_path: Path) -> None:
    from leantrain.demo_context import DEMO_SPEC, DemoContext
    from leantrain.plan.command import demo_stage

    out, _ = console()
    summary = demo_stage(DemoContext(spec_path=DEMO_SPEC, out_dir=tmp_path, console=out))
    assert "1.2e+23 FLOPs → 116 GPUs" in summary
    assert json.loads((tmp_path / "plan.json").read_text())["memory"]["fits"]
    assert (tmp_path / "plan-seed-10b.json").is_file()


def test_ordinary_spec_plans_fast() -> None:
    spec = load_spec(EXAMPLES / "seed-10b.yaml")
    start = time.process_time()  # CPU time: the machine's load is not the planner's (measured 0.09 s)
    make_plan(spec)
    assert time.process_time() - start < 1.0


def test_spec_layout_that_does_not_fit_is_replaced_with_a_note() -> None:
    spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml",
                     overrides=["parallelism.zero_stage=0", "training.activation_checkpointing=none",
                                "training.micro_batch=1", "hardware.memory_gb=40 GB"])
    plan = make_plan(spec)
    assert plan["layout"]["source"] == "search" and plan["memory"]["fits"]
    assert any("spec's layout" in note and "GiB" in note for note in plan["notes"])


@pytest.mark.parametrize(("sets", "named"), [
    (["hardware.peak_flops=989"], "hardware.peak_flops (FLOP/s"),  # TFLOPS for FLOP/s: 1.2e14 GPUs, hours of search
    (["data.tokens_total=1e30"], "data.tokens_total"),
    (["data.tokens_total=.inf"], "data.tokens_total: Input should be a finite number"),  # overflowed in the budget
    (["fault.failures_per_gpu_day=.nan"], "fault.failures_per_gpu_day: Input should be a finite number"),
])
def test_a_budget_beyond_any_cluster_or_not_a_number_is_exit_2_naming_the_field(
        sets: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    from leantrain.cli import main

    seed = Path(__file__).resolve().parents[1] / "examples" / "seed-10b.yaml"
    assert main(["plan", str(seed), *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert main(["plan", str(seed), "--what-if", "gpus=64,9223372036854775807"]) == 2
    assert "more than any cluster" in capsys.readouterr().err


def test_a_plot_suffix_with_no_format_is_exit_2_up_front_and_a_failed_plot_keeps_plan_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib picks the format from the suffix: `--plot p.txt` was its ValueError traceback, after the tables
    and before plan.json was written. Now it is refused first; and a plot that fails (a path that cannot be
    written) fails after plan.json is written, so plan.json is never lost to it."""
    from leantrain.cli import main
    from leantrain.errors import UserInputError as PlotError

    seed = str(EXAMPLES / "seed-10b.yaml")
    json_path = tmp_path / "plan.json"
    for plot_args in (["--what-if", "gpus=64,128", "--plot", str(tmp_path / "p.txt")],
                      ["--what-if", f"gpus=64,plot={tmp_path / 'q.tex'}"]):
        assert main(["plan", seed, "--json", str(json_path), *plot_args]) == 2
        captured = capsys.readouterr()
        assert "plot" in captured.err and ".png, .svg, .pdf" in captured.err and "Traceback" not in captured.err
        assert "budget" not in captured.out  # refused before any planning
    assert not json_path.exists() and not list(tmp_path.iterdir())

    def failing_plot(*args: object, **kwargs: object) -> Path:
        raise PlotError("--plot: cannot be written")

    monkeypatch.setattr("leantrain.plan.command.plot_what_if", failing_plot)
    out, _ = console()
    with pytest.raises(PlotError):
        run(console=out, spec=load_spec(EXAMPLES / "seed-10b.yaml"), json_out=json_path, top=1,
            what_if="gpus=64", plot=tmp_path / "p.svg")
    assert [row["gpus"] for row in json.loads(json_path.read_text())["what_if"]] == [64]
