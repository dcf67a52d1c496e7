"""`leantrain report`: one self-contained HTML file, its numbers, and a headless-Chromium render check."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from leantrain.cli import main
from leantrain.errors import UserInputError
from leantrain.observe.report import demo_stage, write_report
from leantrain.observe.report_cost import cost_and_idle
from leantrain.observe.report_data import load_run
from test_observe_scenarios import STEP_S, make_run

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    message = "chromium is not installed (Debian: apt-get install -y chromium; .ci/run installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def test_report_is_self_contained_with_every_section(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "resume_jump")
    (run_dir / "alerts.jsonl").write_text(
        '{"rule": "loss_spike", "severity": "warning", "state": "firing", "message": "loss 9 vs 3", '
        '"first_seen": 1800000030.0, "last_seen": 1800000050.0, "step": 62}\n')
    out = write_report(run_dir, tmp_path / "r" / "report.html")
    text = out.read_text()
    assert not re.search(r"(src|href)=['\"](?!data:)", text), "report must not reference external files"
    ids = set(re.findall(r"id='plot-(\w+)'", text))
    assert ids == {"loss", "loss_by_source", "grad_norm", "lr", "tokens_per_s", "mfu", "step_time_s", "mem_bytes",
                   "data_wait_s", "comm_s", "timeline"}
    for heading in ("Plan vs actual", "Cost and idle time", "Alerts", "Checkpoints and restarts", "Fault drill"):
        assert f"<h2>{heading}</h2>" in text
    assert "<h2 id=\"run\">Run</h2>" in text and "id='run-card'" in text
    assert "loss 9 vs 3" in text and "20 s" in text  # alert message and how long it lasted
    assert "<td>tokens/s per GPU</td><td>2.048e+04</td><td>2.048e+04</td><td>1.00×</td>" in text
    assert "step-00000040" in text and "restart" in text


def test_cost_and_idle_numbers(tmp_path: Path) -> None:
    cost = cost_and_idle(load_run(make_run(tmp_path, "resume_jump")))
    items = {i.name: i for i in cost.items}
    assert cost.num_gpus == 2 and cost.price_per_gpu_hour == 2.5
    # 60 records × 2 steps × 10 ms data wait; 5 saves × 0.5 s stall; 25 s recovery + 19 redone steps.
    assert items["data wait"].seconds == pytest.approx(60 * 2 * 0.01)
    assert items["checkpoint stalls"].seconds == pytest.approx(2.5)
    assert items["restarts"].seconds == pytest.approx(25 + 19 * STEP_S, rel=0.02)
    assert items["pipeline bubble"].seconds == 0 and "pp = 1" in items["pipeline bubble"].evidence
    restart = items["restarts"]
    assert restart.gpu_hours == pytest.approx(restart.seconds * 2 / 3600)
    assert restart.cost == pytest.approx(restart.gpu_hours * 2.5)
    assert cost.idle_share == pytest.approx(sum(i.seconds for i in cost.items if i.counted) / cost.wall_s)


def test_pipeline_bubble_from_plan_layout(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    run = load_run(run_dir)
    assert run.plan is not None
    run.plan["layout"].update(pp=4, num_microbatches=12)
    items = {i.name: i for i in cost_and_idle(run).items}
    total_step_s = sum(r["step_time_s"] * 2 for r in run.metrics)  # the bubble is a share of compute
    # (pp - 1) / (m + pp - 1) = 3 / 15
    assert items["pipeline bubble"].seconds == pytest.approx(total_step_s * 3 / 15)


def test_report_errors_and_cli(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="metrics.jsonl is missing"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserInputError, match="no metric records"):
        write_report(tmp_path)
    run_dir = make_run(tmp_path, "healthy")
    assert main(["report", str(run_dir)]) == 0 and (run_dir / "report.html").is_file()

    class Ctx:
        out_dir = tmp_path / "demo"
        console = Console(quiet=True)

    with pytest.raises(UserInputError, match="metrics.jsonl"):
        demo_stage(Ctx())
    shutil.copytree(run_dir, Ctx.out_dir / "run")
    assert demo_stage(Ctx()).startswith("report: ")


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    chromium = _chromium()
    out = write_report(make_run(tmp_path, "nan"))
    shot = tmp_path / "report.png"
    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400",
               "--hide-scrollbars", f"--screenshot={shot}", out.as_uri()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    assert shot.is_file(), f"chromium wrote no screenshot (exit {result.returncode}): {result.stderr[-2000:]}"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "report-screenshot.png")
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[:2] == (2400, 1200)
    non_white = np.mean(np.any(pixels < 240, axis=2))
    assert non_white > 0.02, f"screenshot is blank ({non_white:.1%} non-white)"
    red, green, blue_channel = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    # tab:blue and its anti-aliased blends with white: clearly more blue than red and green.
    blue = (blue_channel - red > 50) & (blue_channel - green > 20)
    # The curves of the 8 plots (a 2-column grid, 4 rows) are drawn in matplotlib's tab:blue, and nothing
    # else on the page is blue: a broken or missing image draws none.
    assert blue.sum() > 1000, f"plots did not render ({blue.sum()} plot-blue pixels)"
    half = pixels.shape[1] // 2
    assert blue[:, :half].sum() > 200 and blue[:, half:].sum() > 200, "one column of plots is missing"
    rows = np.flatnonzero(blue.any(axis=1))
    num_bands = 1 + int(np.sum(np.diff(rows) > 40))
    assert num_bands >= 4, f"plot curves found in {num_bands} grid rows, expected 4"


def test_report_without_plan_shows_dashes_not_nan(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "healthy")
    (run_dir / "plan.json").unlink()
    text = write_report(run_dir).read_text()
    table = text.split("<h2>Plan vs actual</h2>")[1].split("<h2>")[0]
    assert "No plan.json" in table and ">nan<" not in table and "<td>tokens/s (job)</td><td>—</td>" in table


def test_plot_lines_attempts_plan_reference_units_and_x_axes(tmp_path: Path) -> None:
    from leantrain.observe.report_plots import PLOTS, metric_lines, plan_reference

    run = load_run(make_run(tmp_path, "resume_jump"))
    lines = metric_lines([run], "loss", 1.0, x="step")
    # The resume starts a second attempt: its own colour and label.
    assert [line.label for line in lines] == ["attempt 1", "attempt 2"] and lines[0].colour != lines[1].colour
    assert plan_reference(run, "tokens_per_s") == pytest.approx(run.plan["throughput"]["tokens_per_s"])  # 2 of 2 GPUs
    assert plan_reference(run, "mfu") == pytest.approx(40.0)
    assert dict((k, u) for k, _, u, _, _ in PLOTS)["loss"] == "nats"
    (ms,) = [line for line in metric_lines([load_run(make_run(tmp_path / "h", "healthy"))], "step_time_s", 1000.0,
                                          x="time")]
    assert np.nanmedian(ms.y) == pytest.approx(STEP_S * 1000, rel=0.05)  # shown in ms
    assert ms.x[0] == 0 and ms.x[-1] == pytest.approx(49 * 2 * STEP_S / 60, rel=0.05)  # minutes since start
    (tokens,) = metric_lines([load_run(make_run(tmp_path / "h2", "healthy"))], "loss", 1.0, x="tokens")
    assert np.all(np.diff(tokens.x) > 0)


def test_report_compares_runs_and_writes_interactive_plots(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    run_a, run_b = make_run(tmp_path / "a", "healthy"), make_run(tmp_path / "b", "data_bound")
    assert main(["report", str(run_a), str(run_b), "--x", "tokens"]) == 0
    text = (run_a / "compare.html").read_text()
    assert "<h2>Runs compared</h2>" in text and "run-data_bound" in text
    out = write_report([run_a, run_b], tmp_path / "i.html", interactive=True)
    html_text = out.read_text()
    assert html_text.count("plotly.js v") == 1 and "Plotly.newPlot" in html_text  # JS inlined once, no CDN
    assert not re.search(r"<script[^>]+src=", html_text)
    assert 'id="plot-tokens_per_s"' in html_text
    assert main(["report", str(run_a), "--x", "epochs"]) == 2


def test_events_are_described_in_words(tmp_path: Path) -> None:
    from leantrain.observe.report import describe_event

    assert describe_event({"kind": "checkpoint_saved", "step": 20, "duration_s": 2.0, "stall_s": 0.5,
                           "async": True}) == "checkpoint saved in 2 s (0.5 s stall, async)"
    assert describe_event({"kind": "restart", "planned": True, "recovery_s": 3.1}) == \
        "restart after a planned drill kill, recovered in 3.1 s"
    assert describe_event({"kind": "rank_joined", "rank": 1, "host": "node1"}) == "rank 1 joined on node1"


def _story_run(tmp_path: Path) -> Path:
    """A healthy run with what the story sections read: per-source held-out losses, a model_ready event with
    per-rank records, a drill result, a sub-second planned checkpoint save."""
    import json

    run_dir = make_run(tmp_path, "healthy")
    with (run_dir / "metrics.jsonl").open("a") as f:
        for step, (en, zh) in ((50, (3.1, 3.6)), (100, (2.4, 2.9))):
            f.write(json.dumps({"step": step, "eval_loss": (en + zh) / 2, "eval_perplexity": 20.0,
                                "eval_loss_by_source": {"en": en, "zh": zh}}) + "\n")
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps({"time": 1800000001.0, "kind": "model_ready", "world_size": 2, "param_bytes_total": 2**30,
                            "ranks": [{"rank": r, "device_mem_peak_bytes": 3 * 2**30, "param_bytes_local": 2**29}
                                      for r in range(2)], "layout": "dp_shard 2"}) + "\n")
    (run_dir / "drill.json").write_text(json.dumps({
        "passed": True, "reason": None, "recovery_s": 20.9, "steps_lost": 1, "goodput": 0.3, "max_loss_diff": 0.0,
        "loss_tolerance": 0.0, "num_restarts": 1, "resumed_from": 2, "kill_at": 3, "kill_rank": 1, "num_ranks": 2,
        "max_steps": 6, "max_restarts": 1, "during_save": False, "corrupt_latest": False}))
    import yaml

    spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
    spec.setdefault("data", {})["sources"] = [{"name": "en", "path": "raw/en.jsonl", "weight": 3.0},
                                              {"name": "zh", "format": "text", "path": "raw/zh", "weight": 1.0}]
    spec["data"]["tokens_total"] = 2.0e6
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(spec))
    plan = json.loads((run_dir / "plan.json").read_text())
    plan.setdefault("checkpoint", {})["save_s"] = 0.002  # a tiny model: the measured save is all fixed costs
    (run_dir / "plan.json").write_text(json.dumps(plan))
    return run_dir


def test_report_tells_the_story_run_card_held_out_by_source_drill_readable_events(tmp_path: Path) -> None:
    from leantrain.observe.report_card import run_card_rows
    from leantrain.observe.report_data import load_run
    from leantrain.observe.report_plots import held_out_by_source

    run_dir = _story_run(tmp_path)
    run = load_run(run_dir)
    card = dict(run_card_rows(run))
    assert {"task", "model", "layout", "precision", "data mixture", "tokens", "batch"} <= set(card)
    assert card["data mixture"] == "en 75% (jsonl), zh 25% (text)"
    assert card["tokens"] == "1.64M trained, 2M planned (data.tokens_total): 81.9% done"
    by_source = held_out_by_source(run)
    assert list(by_source) == ["en", "zh"] and by_source["zh"][1].tolist() == [3.6, 2.9]
    text = write_report(run_dir).read_text()
    assert "id='plot-loss_by_source'" in text
    drill = text.split("<h2>Fault drill</h2>")[1].split("<h2>")[0]
    assert "PASSED" in drill and "rank 1 of 2 at step 3 of 6" in drill and "20.9 s" in drill
    events = text.split("<h2>Checkpoints and restarts</h2>")[1].split("<h2>")[0]
    assert "model built and sharded: 1 GiB of parameters over 2 rank(s), peak memory 3 GiB" in events
    assert "{'" not in events and "[{" not in events  # no raw Python/JSON in the events table
    plan_table = text.split("<h2>Plan vs actual</h2>")[1].split("<h2>")[0]
    save_row = next(row for row in plan_table.split("<tr>") if "checkpoint save time" in row)
    assert "×" not in save_row and "fixed costs dominate" in save_row


def test_events_without_a_sentence_are_listed_with_units() -> None:
    from leantrain.observe.report import describe_event

    text = describe_event({"kind": "data_stall", "step": 5, "wait_s": 1.25, "buffer_bytes": 3 * 2**20,
                           "ranks": [{"rank": 1, "host": "n1"}], "hosts": ["n1", "n2"]})
    assert text == "wait s: 1.25 s; buffer bytes: 3 MiB; ranks: 1 (rank 1, host n1); hosts: n1, n2"
    assert describe_event({"kind": "checkpoint_deleted", "event": "checkpoint_deleted", "folder": "step-00000020",
                           "reason": "beyond keep_last=2"}) == "checkpoint step-00000020 deleted: beyond keep_last=2"


VISIBILITY_SCRIPT = """<script>
window.addEventListener('load', () => {
  const seen = el => { const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.visibility !== 'hidden' && s.display !== 'none'; };
  const out = {headings: {}, images: {}};
  document.querySelectorAll('h2').forEach(h => { out.headings[h.textContent.trim()] = seen(h); });
  document.querySelectorAll('img.plot').forEach(i => {
    out.images[i.id] = seen(i) && i.complete && i.naturalWidth > 0; });
  out.card = seen(document.getElementById('run-card'));
  const pre = document.createElement('pre'); pre.id = 'visibility';
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
});
</script>"""


def test_report_sections_are_present_and_visible_in_headless_chromium(tmp_path: Path) -> None:
    """The page as a browser lays it out: every section heading and the run card visible, every plot image
    decoded (a broken data: URI has no natural width)."""
    import html
    import json

    chromium = _chromium()
    page = write_report(_story_run(tmp_path)).read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", VISIBILITY_SCRIPT + "</body>"))
    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400",
               "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    found = re.search(r"<pre id=\"visibility\">(.*?)</pre>", result.stdout, flags=re.S)
    assert found, f"chromium ran no script (exit {result.returncode}): {result.stderr[-2000:]}"
    seen = json.loads(html.unescape(found.group(1)))
    for heading in ("Run", "Training curves", "Plan vs actual", "Cost and idle time", "Alerts",
                    "Checkpoints and restarts", "Fault drill"):
        assert seen["headings"].get(heading) is True, (heading, seen["headings"])
    assert seen["card"] is True
    assert {"plot-loss", "plot-loss_by_source", "plot-timeline"} <= set(seen["images"])
    assert all(seen["images"].values()), seen["images"]


def test_a_hand_edited_eval_json_or_per_source_map_is_named_in_the_report(tmp_path: Path) -> None:
    """eval.json with a missing key or a wrong type, or a metrics record whose loss_by_source is not an object,
    were KeyError/AttributeError/ValueError tracebacks and no report. Like an eval.json that is not JSON (listed
    under unreadable lines), each is named (file and key) and the rest of the report is written."""
    import json

    run_dir = make_run(tmp_path, "healthy")
    good = {"step": 40, "held_out": {"web.en": {"loss": 2.5, "perplexity": 12.18},
                                     "prefs": {"loss": 0.6, "rewards/margin": 0.25, "rewards/accuracy": 0.75}},
            "tasks": {"quiz": {"acc": 0.5, "acc_norm": 0.625, "num_questions": 8}}}
    (run_dir / "eval.json").write_text(json.dumps(good))
    section = write_report(run_dir).read_text().split("<h2>Evaluation (step 40)</h2>")[1].split("</table>")[0]
    for row in ("held-out web.en</td><td>loss 2.5000, perplexity 12.18", "reward margin 0.250, accuracy 0.750",
                "acc 0.500, acc_norm 0.625 (8 questions)"):
        assert row in section
    for edited, named in (({"held_out": {"web.en": {"loss": "2.5"}}},
                           "key &#x27;held_out.web.en.loss&#x27;: expected a number, got a string"),
                          ({"held_out": {"prefs": {"loss": 0.6}}}, "no key &#x27;held_out.prefs.rewards/margin"),
                          ({"tasks": [{"acc": 0.5}]}, "key &#x27;tasks&#x27;: expected an object, got a list")):
        (run_dir / "eval.json").write_text(json.dumps(edited))
        assert main(["report", str(run_dir)]) == 0
        section = (run_dir / "report.html").read_text().split("<h2>Evaluation</h2>")[1].split("</p>")[0]
        assert str(run_dir / "eval.json") in section and named in section, section
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    record["loss_by_source"] = ["en", "zh"]
    lines[3] = json.dumps(record)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    text = write_report(run_dir).read_text()
    assert f"metrics.jsonl: step {record['step']}: loss_by_source is not an object" in text
    assert "id='plot-loss_by_source'" in text  # the other records' per-source losses are still drawn


def test_a_drill_verdict_that_is_not_true_is_not_shown_as_passed_and_a_non_object_file_is_named(
        tmp_path: Path) -> None:
    """The report showed a hand-edited `"passed": "no"` as PASSED (truthiness), where validate fails it; and a
    drill.json or plan.json whose top level is not an object was dropped without a word."""
    import json

    run_dir = make_run(tmp_path, "healthy")
    (run_dir / "drill.json").write_text(json.dumps({"passed": "no", "reason": "edited"}))
    assert "<b class='critical'>FAILED</b>" in write_report(run_dir).read_text()
    (run_dir / "drill.json").write_text(json.dumps([{"passed": True}]))
    text = write_report(run_dir).read_text()
    assert "drill.json: not a JSON object (a list); left out" in text and "PASSED" not in text


@pytest.mark.parametrize("bad", ['{"step": "x"}', '{"step": null, "loss": 2.0}', '{"loss": 2.0}',
                                 '{"step": true, "loss": 2.0}'])
def test_a_metrics_record_whose_step_is_not_a_number_is_an_unreadable_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    """A record whose step is not a number (hand-edited, another tool's file) was a ValueError traceback in the
    timeline plot or the compare table. It is listed under the unreadable lines, like a torn line, and left out
    of the plots; a file with no record left is exit 2 naming it, and no report is written."""
    only_bad = tmp_path / "only-bad"
    only_bad.mkdir()
    (only_bad / "metrics.jsonl").write_text(bad + "\n")
    out = tmp_path / "out" / "report.html"
    run_dir = make_run(tmp_path, "healthy")
    for command in (["report", str(only_bad)], ["report", str(run_dir), str(only_bad)]):
        assert main([*command, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{only_bad / 'metrics.jsonl'} holds no metric records" in err and "metrics.jsonl:1:" in err
        assert "Traceback" not in err and not out.exists()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join([*lines[:3], bad, *lines[3:]]) + "\n")
    (only_bad / "metrics.jsonl").write_text(bad + "\n" + lines[0] + "\n")
    assert len(load_run(run_dir).metrics) == len(lines)
    assert main(["report", str(run_dir), str(only_bad), "--out", str(out)]) == 0
    text = write_report(run_dir).read_text()
    assert "<h2>Unreadable lines</h2>" in text and "metrics.jsonl:4: " in text and "left out" in text
