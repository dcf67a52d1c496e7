"""The `leantrain` command line: one thin command per stage (typer + rich).

Exit codes (docs/architecture.md): 0 success, 1 a check failed, 2 the user's input is wrong.
User errors are printed without a traceback. Each command imports its stage's module only when it runs, so
`leantrain --help` and the light commands never pay for importing torch.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from leantrain.errors import (
    AlreadyRefused,
    LeantrainError,
    UserInputError,
    check_output_file,
    earlier_refusal,
    record_refusal,
)
from leantrain.spec import JobSpec, load_spec

app = typer.Typer(
    name="leantrain",
    help="From a compute budget to a validated, self-healing LLM training run.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish (README)
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"leantrain {version('leantrain')}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", help="Print the version and exit.", callback=_print_version, is_eager=True)] = False) -> None:
    """From a compute budget to a validated, self-healing LLM training run."""

SpecArg = Annotated[Path, typer.Argument(help="The YAML job spec.", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a spec field: --set training.lr=1e-4 (repeatable)."),
]
ProfileOpt = Annotated[
    str | None, typer.Option("--profile", help="Apply the spec's named overlay (scale and resources).")
]


def _run_dir_argument(ctx: typer.Context, value: Path | list[Path] | None) -> Path | list[Path] | None:
    """Refuse a run dir argument that names a file (the command checks a missing one itself)."""
    for path in [] if ctx.resilient_parsing else value if isinstance(value, list) else [value]:
        if path is not None and path.exists() and not path.is_dir():
            takes = "a run dir (the folder train/launch wrote)"
            if ctx.info_name == "runs":
                takes += f" or a folder of run dirs; a registry file goes after --registry: --registry {path}"
            raise UserInputError(f"{path} is a file, not a run dir: `leantrain {ctx.info_name}` takes {takes}")
    return value


RunDirArg = Annotated[Path, typer.Argument(
    help="A run dir written by train/launch.", show_default=False, callback=_run_dir_argument)]
ResumeOpt = Annotated[str, typer.Option(
    help="Where to start: auto (newest valid checkpoint of the run, else fresh), none (start over: a run dir "
    "without checkpoints), latest, a STEP, or a checkpoint PATH (step folder, run dir, s3://...).")]
WeightsOnlyOpt = Annotated[bool, typer.Option(
    "--weights-only", help="With --resume PATH: load only the model weights into a new run (step 0).")]
ExtendOpt = Annotated[bool, typer.Option(
    "--extend-schedule", help="Resume although max steps/LR/schedule/batch changed: go on with the new settings.")]

def _spec(path: Path, sets: list[str] | None, profile: str | None) -> JobSpec:
    return load_spec(path, profile=profile, overrides=sets or [])


def _stage(module: str, *, entry: str = "run", **kwargs: Any) -> None:
    """Run `run(console=..., **kwargs)` (or another `entry`) of the module that owns a stage."""
    getattr(importlib.import_module(module), entry)(console=console, **kwargs)


RehearseOpt = Annotated[bool, typer.Option(
    "--rehearse", help="Also rehearse the layout at its world size on this CPU (leantrain rehearse).")]
RehearseJsonOpt = Annotated[Path | None, typer.Option(
    "--rehearsal-json", help="With --rehearse: where rehearsal.json goes (default ./rehearsal.json).")]


def _rehearsal_json_needs_rehearse(rehearse: bool, rehearsal_json: Path | None) -> None:
    """--rehearsal-json without --rehearse was ignored (nothing written, no word): refuse it."""
    if rehearsal_json is not None and not rehearse:
        raise UserInputError(f"--rehearsal-json {rehearsal_json} is where --rehearse writes: add --rehearse")
    check_output_file(rehearsal_json, "--rehearsal-json")


@app.command()
def check(spec: SpecArg, set_: SetOpt = None, profile: ProfileOpt = None, rehearse: RehearseOpt = False,
          rehearsal_json: RehearseJsonOpt = None) -> None:
    """Validate a job spec and show the resolved model shape. Reads SPEC; writes nothing (rehearsal.json with
    --rehearse)."""
    from leantrain.render import render_spec_summary

    _rehearsal_json_needs_rehearse(rehearse, rehearsal_json)
    job = _spec(spec, set_, profile)
    render_spec_summary(job, console=console)
    if rehearse:
        _stage("leantrain.golive.rehearse", spec=job, json_out=rehearsal_json, planned=False, entry="run_after")


@app.command()
def plan(
    spec: SpecArg,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write plan.json here.")] = None,
    top: Annotated[int, typer.Option(min=1, help="Layouts to show.")] = 5,
    what_if: Annotated[str | None, typer.Option("--what-if", help="e.g. gpus=64,128,256")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="With --what-if: write a plot of days/cost here (PNG, SVG, PDF, ... by the suffix).")] = None,
    calibrate: Annotated[list[Path] | None, typer.Option(
        "--calibrate", help="Run dir of an earlier run on the same hardware (repeatable): fit the step-time "
        "constants to its measured step times first.")] = None,
    rehearse: RehearseOpt = False,
    rehearsal_json: RehearseJsonOpt = None,
) -> None:
    """Compute budget, GPU count, per-GPU memory, best layout, storage, checkpoint interval, cost.

    Reads SPEC (and with --calibrate the run dirs' spec.yaml, plan.json, metrics.jsonl); prints a table and
    writes plan.json with --json.
    """
    if plot is not None and what_if is None:
        raise UserInputError("--plot draws the --what-if table: add --what-if gpus=64,128,256")
    _rehearsal_json_needs_rehearse(rehearse, rehearsal_json)
    for path, option in ((json_out, "--json"), (plot, "--plot")):
        check_output_file(path, option)
    job = _spec(spec, set_, profile)
    _stage("leantrain.plan.command", spec=job, json_out=json_out, top=top, what_if=what_if, plot=plot,
           calibrate=calibrate)
    if rehearse:
        _stage("leantrain.golive.rehearse", spec=job, json_out=rehearsal_json, planned=True, entry="run_after")


@app.command()
def rehearse(
    spec: SpecArg,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    world: Annotated[int | None, typer.Option(
        "--world", min=1, help="World size (default: the spec's layout).")] = None,
    ranks: Annotated[str | None, typer.Option(
        "--ranks", help="Ranks to rehearse, e.g. 0,last,17 (default: one per pipeline stage: 0, the last, and "
                        "the first of each stage between).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Where to write rehearsal.json.")] = None,
    depth: Annotated[str, typer.Option(
        "--depth", help="auto: a deep model at 1 and 2 layers per pipeline chunk, extended to its depth; "
        "full: every layer.")] = "auto",
) -> None:
    """Run the real job's ranks at the real world size on this CPU (fake process group, fake tensors).

    Reads SPEC (and data.dir when it is here); writes rehearsal.json: memory by category, collectives, control
    calls and host syncs per step, files read at startup, plan vs rehearsal. Exit 1 when a rank does not fit.
    """
    check_output_file(json_out, "--json")
    job = _spec(spec, set_, profile)
    _stage("leantrain.golive.rehearse", spec=job, world=world, ranks=ranks, json_out=json_out, depth=depth)


@app.command()
def prepare(
    spec: SpecArg,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    out: Annotated[Path | None, typer.Option(help="Data dir to write (default: data.dir).")] = None,
    probe: Annotated[bool, typer.Option(help="Only trial-read an existing data dir.")] = False,
    force: Annotated[bool, typer.Option(help="Rebuild a finished data dir whose inputs changed.")] = False,
) -> None:
    """Clean, deduplicate, filter PII, tokenize, shard and mix the spec's data sources.

    Reads data.sources; writes the data dir (manifest.json, tokenizer.json, .bin/.idx shards, report.json).
    """
    job = _spec(spec, set_, profile)
    if not probe:
        _not_a_run_dir(Path(out or job.data.dir), "--out" if out is not None else "data.dir")
    _stage("leantrain.data.command", spec=job, out=out, probe=probe, force=force)


def _not_a_run_dir(data_dir: Path, option: str) -> None:
    """Refuse, before anything is written, a data dir that is a training run's dir (its lineage.json): the data's
    files would mix with the run's (train and launch refuse a data dir as their run dir the same way)."""
    from leantrain.provenance.lineage import LINEAGE_FILE_NAME

    if (data_dir / LINEAGE_FILE_NAME).is_file():
        raise UserInputError(f"{option} {data_dir} is a training run's dir (it holds {LINEAGE_FILE_NAME}): prepare "
                             "data into a dir of its own")


@app.command()
def train(
    spec: SpecArg,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    run_dir: Annotated[Path | None, typer.Option(help="Run dir (default: run.dir).")] = None,
    max_steps: Annotated[int | None, typer.Option(min=0, help="Stop after this many steps.")] = None,
    resume: ResumeOpt = "auto",
    weights_only: WeightsOnlyOpt = False,
    extend_schedule: ExtendOpt = False,
) -> None:
    """Train: one process, or one rank under torchrun.

    Reads SPEC and the data dir; writes the run dir (metrics.jsonl, checkpoints/, lineage.json).
    SIGINT/SIGTERM save a checkpoint at the current step and exit 130/143.
    """
    earlier_refusal()  # a restarted rank of a launch whose ranks refused the job: refuse again at once
    job = _spec(spec, set_, profile)  # spec errors first: before parse_resume's module imports torch
    from leantrain.ckpt.resume import parse_resume

    request = parse_resume(resume, weights_only=weights_only, extend_schedule=extend_schedule)
    _stage("leantrain.train.command", spec=job, run_dir=run_dir, max_steps=max_steps, resume=request)


@app.command()
def launch(
    spec: SpecArg,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    nproc: Annotated[int | None, typer.Option(min=1, help="Processes per node.")] = None,
    nnodes: Annotated[str | None, typer.Option(help="Nodes, or MIN:MAX for elastic.")] = None,
    max_restarts: Annotated[int | None, typer.Option(min=0, help="Override fault.max_restarts.")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Run dir (default: run.dir).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Build the layout with a fake process group.")] = False,
    preflight: Annotated[bool, typer.Option(help="Check every rank before training.")] = False,
    sweep: Annotated[str | None, typer.Option(help="Scaling sweep, e.g. nproc=1,2,4: tokens/s and efficiency.")] = None,
    emit: Annotated[str | None, typer.Option(help="Write a job file instead: slurm or k8s.")] = None,
    out: Annotated[Path | None, typer.Option(help="Where --emit writes.")] = None,
    resume: ResumeOpt = "auto",
    weights_only: WeightsOnlyOpt = False,
    extend_schedule: ExtendOpt = False,
    max_steps: Annotated[int | None, typer.Option(min=0, help="Stop after this many steps (0: build the model, "
                                                  "record model_ready, exit).")] = None,
) -> None:
    """Launch distributed training with torchrun (or write a Slurm/Kubernetes job file).

    Reads SPEC; writes the run dir (one log per rank) or the --emit job file.
    """
    check_output_file(out, "--out")  # a folder or a path under a file: refused before any job file is written
    job = _spec(spec, set_, profile)  # spec errors first: before parse_resume's module imports torch
    if emit is not None:  # a job file without an image or node set-up: refused before torch is imported too
        from leantrain.launch.job_spec import check_emit

        check_emit(job, kind=emit, dry_run=dry_run)
    from leantrain.ckpt.resume import parse_resume

    request = parse_resume(resume, weights_only=weights_only, extend_schedule=extend_schedule)
    _stage(
        "leantrain.launch.command", spec=job, spec_path=spec, overrides=set_ or [], profile=profile,
        nproc=nproc, nnodes=nnodes, max_restarts=max_restarts, run_dir=run_dir, dry_run=dry_run,
        preflight=preflight, sweep=sweep, emit=emit, out=out,
        train_args=(*request.cli_args(), *(() if max_steps is None else ("--max-steps", str(max_steps)))),
    )


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="Run dir; more run dirs are overlaid and compared.", callback=_run_dir_argument)],
    out: Annotated[Path | None, typer.Option(
        help="HTML file (default: RUN_DIR/report.html, or RUN_DIR/compare.html for several).")] = None,
    x: Annotated[str, typer.Option("--x", help="x axis: step, time (minutes) or tokens.")] = "step",
    interactive: Annotated[bool, typer.Option(
        "--interactive", help="Zoomable plotly charts (plotly's JavaScript inlined: still one file).")] = False,
) -> None:
    """Write a self-contained HTML report with plots. Reads RUN_DIR(s); writes report.html."""
    check_output_file(out, "--out")
    _stage("leantrain.observe.report", run_dir=run_dirs if len(run_dirs) > 1 else run_dirs[0], out=out, x=x,
           interactive=interactive)


@app.command()
def validate(
    run_dir: RunDirArg,
    plan_file: Annotated[Path | None, typer.Option("--plan", help="plan.json to compare with.")] = None,
    baseline: Annotated[Path | None, typer.Option(help="A baseline run dir.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the verdict as JSON.")] = None,
) -> None:
    """Go-live checks (health, convergence, throughput, memory, comm, fault drill). Exit 0 only on PASS.

    Reads RUN_DIR (and --plan, --baseline); prints a table, writes --json.
    """
    check_output_file(json_out, "--json")
    _stage("leantrain.golive.validate", run_dir=run_dir, plan_file=plan_file, baseline=baseline, json_out=json_out)


@app.command()
def drill(
    spec: SpecArg,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    run_dir: Annotated[Path | None, typer.Option(help="Run dir (default: run.dir).")] = None,
    kill_at: Annotated[int | None, typer.Option(min=1, help="Kill a rank at this step.")] = None,
    during_save: Annotated[bool, typer.Option(help="Kill while a checkpoint is being written.")] = False,
    corrupt_latest: Annotated[bool, typer.Option(help="Corrupt the newest checkpoint first.")] = False,
) -> None:
    """Fault drill: kill a process, check automatic restart and a continuous resumed loss curve.

    Reads SPEC; writes a run dir and drill.json. Exit 0 only when the drill passes.
    """
    job = _spec(spec, set_, profile)
    _stage(
        "leantrain.golive.drill", spec=job, spec_path=spec, overrides=set_ or [], profile=profile,
        run_dir=run_dir, kill_at=kill_at, during_save=during_save, corrupt_latest=corrupt_latest,
    )


@app.command()
def doctor(
    run_dir: Annotated[Path | None, typer.Argument(
        help="A run dir to diagnose (optional).", callback=_run_dir_argument)] = None,
) -> None:
    """Check the environment and diagnose a run (hangs, low MFU, OOM, divergence, flapping nodes).

    Reads RUN_DIR when given; writes nothing.
    """
    _stage("leantrain.golive.doctor", run_dir=run_dir)


@app.command("alert-rules")
def alert_rules(
    spec: SpecArg,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
    plan_file: Annotated[Path | None, typer.Option("--plan", help="plan.json, for the MFU floor.")] = None,
    out: Annotated[Path | None, typer.Option(help="Rules file to write (default: stdout).")] = None,
) -> None:
    """Prometheus alerting rules from the spec's alert rules, for operators who run Prometheus/Alertmanager.

    Reads SPEC (and --plan); writes the rules file.
    """
    check_output_file(out, "--out")
    job = _spec(spec, set_, profile)
    _stage("leantrain.observe.prometheus", spec=job, plan_file=plan_file, out=out)


@app.command()
def runs(
    run_dir: Annotated[Path | None, typer.Argument(
        help="A run dir: its checkpoints and lineage; a folder of run dirs: the runs in its runs.db.",
        callback=_run_dir_argument)] = None,
    registry: Annotated[Path | None, typer.Option(
        help="Registry database (default: $LEANTRAIN_REGISTRY, $LEANTRAIN_HOME/runs.db, or runs/runs.db).")] = None,
) -> None:
    """List runs from the run registry, or show what produced each checkpoint of one run.

    Reads the SQLite registry (and RUN_DIR's lineage.json); writes nothing.
    """
    _stage("leantrain.provenance.registry", run_dir=run_dir, registry=registry)


@app.command()
def export(
    run_dir: RunDirArg,
    out: Annotated[Path, typer.Option("--out", help="The Hugging Face directory to write (new or empty).")],
    step: Annotated[int | None, typer.Option("--step", min=0, help="Checkpoint step (default: the newest).")] = None,
    adapter_only: Annotated[bool, typer.Option(
        "--adapter-only", help="LoRA runs: write a PEFT adapter instead of the merged model.")] = False,
    base_as_trained: Annotated[bool, typer.Option(
        "--base-as-trained", help="QLoRA runs: merge onto the NF4-rounded base the run trained on.")] = False,
) -> None:
    """Export a run's checkpoint as a Hugging Face model dir (config.json, safetensors, tokenizer).

    Reads RUN_DIR (spec.yaml, checkpoints, base_model.json for LoRA); writes --out only.
    """
    _stage("leantrain.ckpt.export", run_dir=run_dir, out=out, step=step, adapter_only=adapter_only,
           base_as_trained=base_as_trained)


@app.command("eval")
def eval_(
    target: Annotated[Path, typer.Argument(help="A run dir (its checkpoint) or a spec (its model.init_from).",
                                           show_default=False)],
    tasks: Annotated[list[Path] | None, typer.Option(
        "--tasks", help="Multiple-choice JSONL {question, choices, answer} (repeatable).")] = None,
    step: Annotated[int | None, typer.Option("--step", min=0, help="Checkpoint step (default: the newest).")] = None,
    base_as_trained: Annotated[bool, typer.Option(
        "--base-as-trained", help="QLoRA runs: the adapters on the NF4 base the run trained on.")] = False,
    set_: SetOpt = None,
    profile: ProfileOpt = None,
) -> None:
    """Held-out loss/perplexity per source and multiple-choice accuracy (log-likelihood, lm-eval style).

    Reads RUN_DIR (spec.yaml, checkpoint) or SPEC, the data dir and the task files; writes eval.json in the run dir.
    --set and --profile apply to the spec (a run dir's spec.yaml too: e.g. another data.dir to score).
    """
    _stage("leantrain.golive.eval", target=target, tasks=tasks or [], step=step, base_as_trained=base_as_trained,
           sets=set_ or [], profile=profile)


@app.command()
def demo(
    dir_: Annotated[Path, typer.Option("--dir", help="Where the demo writes.")] = Path("demo-out"),
) -> None:
    """Run the whole chain on the bundled corpus on the CPU. Writes under --dir."""
    from leantrain.demo import run_demo

    run_demo(out_dir=dir_, console=console)


@app.command()
def completion(
    shell: Annotated[str, typer.Argument(help="bash, zsh or fish.", show_default=False)],
) -> None:
    """Print the shell completion script: `eval "$(leantrain completion bash)"` in ~/.bashrc, or
    `leantrain completion zsh > ~/.zfunc/_leantrain` (with ~/.zfunc on fpath). Reads nothing; writes stdout."""
    from typer.completion import get_completion_script

    if shell not in ("bash", "zsh", "fish"):
        raise UserInputError(f"completion {shell!r}: allowed: bash, zsh, fish")
    sys.stdout.write(get_completion_script(prog_name="leantrain", complete_var="_LEANTRAIN_COMPLETE", shell=shell))


# Third-party log lines that read as errors but are not: torchao lists the CUDA kernels it cannot load on this
# build ("Failed to load ..._C_mxfp8...so"), torch notes a deprecation inside torchao's own registration code.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party() -> None:
    """Raise the noisy loggers to ERROR and drop library deprecation warnings the user cannot act on."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch|torchao|transformers|peft)(\.|$)")


quiet_third_party()  # at import: scripts that import the CLI (scripts/tiny_hf_jobs.py) import torchao before main


def _refused(args: list[str], code: int, message: str, err: BaseException) -> int:
    """`code`, after recording an exit 2 of `train` as the launch's refusal (errors.record_refusal: the one way
    `launch`, the Slurm script and the Kubernetes container learn that the ranks refused the job), unless it may
    pass on retry (an IntegrityError that is not `permanent`) or repeats a refusal recorded before."""
    command = next((arg for arg in args if not arg.startswith("-")), None)  # the app takes no option values
    if code == 2 and command == "train" and getattr(err, "permanent", True) and not isinstance(err, AlreadyRefused):
        record_refusal(message)
    return code


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: user errors become a message and an exit code, not a traceback."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        app(args=args, prog_name="leantrain", standalone_mode=False)
    except LeantrainError as err:
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        return _refused(args, err.exit_code, str(err), err)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        err_console.print("aborted")
        return 130
    except (IsADirectoryError, NotADirectoryError, FileExistsError, FileNotFoundError, PermissionError) as err:
        # a path given on the command line or in the spec that is not what the command needs (a folder for a
        # file, a file for a folder, a file that is missing or may not be read or written): name it
        paths = " → ".join(str(p) for p in (err.filename, err.filename2) if p is not None) or "a path"
        message = f"{paths}: {err.strerror or err} (check that path, given on the command line or in the spec)"
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        return _refused(args, 2, message, err)
    except Exception as exc:
        # Usage errors from typer's bundled click: duck-typed, since typer vendors its own click copy.
        if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            return _refused(args, exc.exit_code, f"usage: {message}", exc)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
