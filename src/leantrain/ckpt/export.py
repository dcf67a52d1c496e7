"""`leantrain export RUN_DIR --out DIR [--step N] [--adapter-only]`: a DCP checkpoint → a Hugging Face directory.

Output: config.json (the init_from checkpoint's, updated with our shape, or a LlamaConfig), model.safetensors
(or `model-0000i-of-0000n.safetensors` shards + index, one shard in memory at a time: tensors are read
from DCP by name, a group at a time, never the whole model), and the tokenizer files (the model's, or the
data dir's tokenizer.json). A LoRA run's checkpoint holds only the adapters: the export reads the base from
`base_model.json`'s init_from after checking its sha256, and writes W + (alpha / rank) · B A for each
adapted weight; `--adapter-only` writes a PEFT-format adapter instead (adapter_config.json +
adapter_model.safetensors, loadable with `peft.PeftModel.from_pretrained(base, DIR)`).

Everything is written to a temporary sibling folder and renamed at the end: on any error nothing appears
at `--out`, and an existing non-empty `--out` is refused.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

import leantrain.ckpt.integrity as integ
from leantrain.ckpt.base_ref import verify_base
from leantrain.ckpt.crypto import TamperError
from leantrain.ckpt.dcp_io import SealedFileSystem, SealedReader
from leantrain.ckpt.errors import CheckpointLoadError, one_line, root_cause
from leantrain.ckpt.identity import MODEL_KEY, OTHER_MODEL, identity_problem, model_identity
from leantrain.ckpt.manager import _make_cipher
from leantrain.ckpt.storage import open_store
from leantrain.ckpt.verified_load import read_metadata
from leantrain.errors import LeantrainError, UserInputError
from leantrain.model.hf import (
    CONFIG_FILE,
    from_hf_expert_name,
    from_hf_name,
    hf_config,
    plan_shards,
    to_hf_name,
    write_hf_shards,
)
from leantrain.model.hf_load import open_weights, weight_files
from leantrain.model.lora import is_adapter, nf4_round
from leantrain.model.transformer import model_args_from_spec
from leantrain.spec import JobSpec, load_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# What a damaged file raises inside DCP's read (a short read, bytes that do not unpickle or decrypt): named
READ_ERRORS = (OSError, EOFError, ValueError, RuntimeError, pickle.UnpicklingError, TamperError, LeantrainError)


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    step: int
    num_tensors: int
    merged_lora: bool
    adapter_only: bool
    no_tokenizer: str = ""  # why no tokenizer.json was written (said, not skipped without a word)


class DcpTensors:
    """Read named tensors of a checkpoint's model state (`model.<name>` keys) a group at a time.

    Opening checks, once, what the reads rely on: the commit marker and manifest, that the checkpoint holds the
    spec's model (its manifest's model fingerprint, ckpt/identity.py, as a resume checks it), DCP's `.metadata`
    against the manifest, and every file's size (one listing of the folder, no read). A failed check, or a read
    that fails later, is a UserInputError naming the checkpoint folder and the file (exit 2)."""

    def __init__(self, spec: JobSpec, run_dir: Path, *, step: int | None) -> None:
        store = open_store(spec, run_dir=run_dir)
        good = [e for e in integ.list_steps(store) if e.good_candidate]
        entries = good if step is None else [e for e in good if e.step == step]
        if not entries:
            which = f"step {step}" if step is not None else "any step"
            raise UserInputError(f"{run_dir}: no committed checkpoint for {which} in {store.url}")
        self.entry = entries[-1]
        self.run_dir, self.where = run_dir, store.describe(self.entry.name)
        self._other_steps = [e.step for e in good if e.step != self.entry.step]
        try:
            manifest = integ.read_manifest(store, self.entry.name)
            self._check_model(spec, manifest)
            cipher = _make_cipher(spec) if manifest.get("encryption") else None
            self.fs = SealedFileSystem(store, cipher=integ.check_key(self.entry.name, manifest, cipher=cipher))
            metadata = read_metadata(self.fs, self.entry.name, manifest).state_dict_metadata
            integ.check_sizes(store, self.entry.name, manifest)
        except integ.IntegrityError as err:
            raise self._unreadable(err) from None
        self._records = manifest["files"]
        self.meta = {key.removeprefix("model."): md for key, md in metadata.items() if key.startswith("model.")}

    def _check_model(self, spec: JobSpec, manifest: dict) -> None:
        """Refuse a checkpoint of another model than the spec's (e.g. `--set model.vocab_size=N`), naming the
        fields that differ, or one whose manifest is not the step its folder says."""
        expected = model_identity(spec)
        problem = identity_problem(folder_step=self.entry.step, manifest=manifest, expected=expected)
        if problem is None:
            return
        if problem[0] != OTHER_MODEL:
            raise UserInputError(f"{self.run_dir}: checkpoint {self.where}: {problem[1]}")
        differences = shape_differences(manifest[MODEL_KEY].get("shape"), expected["shape"]) or [
            "the same shape with other adapters (finetune.method, finetune.lora.rank or finetune.lora.targets)"]
        raise UserInputError(f"{self.run_dir}: checkpoint {self.where} holds another model than the spec describes: "
                             f"{'; '.join(differences)}. Use the spec the run was trained with (its spec.yaml, "
                             "without --set for these fields)")

    def _unreadable(self, err: BaseException) -> UserInputError:
        if isinstance(err, integ.KeyMismatchError):  # every step is sealed with the same key: another step won't do
            others = "set security.encryption_key to the key this run was encrypted with"
        else:
            others = (f"committed checkpoints of other steps: {', '.join(map(str, self._other_steps))} (--step N)"
                      if self._other_steps else "there is no other committed checkpoint")
        return UserInputError(f"{self.run_dir}: checkpoint step {self.entry.step} ({self.where}) cannot be read: "
                              f"{one_line(err) if not isinstance(err, LeantrainError) else err}; {others}")

    def sizes(self) -> dict[str, int]:
        return {name: md.size.numel() * md.properties.dtype.itemsize for name, md in self.meta.items()}

    def load(self, names: list[str], *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        state = {"model": {n: torch.empty(self.meta[n].size, dtype=self.meta[n].properties.dtype) for n in names}}
        try:
            dcp.load(state, storage_reader=SealedReader(self.fs, self.entry.name), no_dist=True)
        except (Exception, CheckpointException) as err:
            cause = root_cause(err)
            if not isinstance(cause, READ_ERRORS):
                raise
            # A transient store error (a timeout, a dropped connection) is said as it is: hashing every file of
            # the checkpoint to find a damaged one is for reads that failed on what the bytes are
            transient = isinstance(cause, TimeoutError | ConnectionError) or getattr(cause, "permanent", True) is False
            if transient:  # not the user's input: exit 1, and another try may pass
                raise CheckpointLoadError(f"{self.run_dir}: reading checkpoint step {self.entry.step} ({self.where}) "
                                          f"failed: {one_line(cause)}; try again") from None
            raise self._unreadable(self._damaged_file() or cause) from None
        return {name: tensor.to(dtype) for name, tensor in state["model"].items()}

    def _damaged_file(self) -> integ.IntegrityError | None:
        """After a failed read: the first file that fails its manifest's sha256 (a hashing pass, only then)."""
        for name, record in sorted(self._records.items()):
            try:
                integ.verify_file(self.fs.store, self.entry.name, name, record, cipher=self.fs.cipher)
            except integ.IntegrityError as err:
                return err
            except Exception:  # noqa: BLE001 - e.g. a store error: the read's own error is the one reported
                return None
        return None


def shape_differences(saved: dict[str, Any] | None, expected: dict[str, Any]) -> list[str]:
    """`model.vocab_size 64 in the checkpoint, 128 in the spec` for each field of two model shapes
    (ckpt/identity.py's `shape`) that differs; nested settings (moe, mla) field by field."""
    saved = saved if isinstance(saved, dict) else {}
    lines = []
    for key in sorted(set(saved) | set(expected)):
        field = "model." + ("head_dim" if key == "attn_head_dim" else key)
        ours, theirs = saved.get(key), expected.get(key)
        if isinstance(ours, dict) and isinstance(theirs, dict):
            lines += [f"{field}.{k} {ours.get(k)} in the checkpoint, {theirs.get(k)} in the spec"
                      for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        elif ours != theirs:
            lines.append(f"{field} {ours} in the checkpoint, {theirs} in the spec")
    return lines


def _base_tensor(files: dict[str, Path], name: str, experts: dict[str, list[str]]) -> torch.Tensor:
    """Our tensor `name` from the base's safetensors: one HF tensor, or a stack of routed experts (experts, in,
    out) gathered from each expert's (out, in) weight."""
    if name in experts:
        return torch.stack([_hf_tensor(files, hf_name).t() for hf_name in experts[name]])
    return _hf_tensor(files, to_hf_name(name))


def _hf_tensor(files: dict[str, Path], hf_name: str) -> torch.Tensor:
    with open_weights(files[hf_name]) as handle:
        return handle.get_tensor(hf_name)


def _lora_loader(
    spec: JobSpec, dcp_tensors: DcpTensors, base: Path, dtype: torch.dtype, *, base_as_trained: bool = False
) -> tuple[Any, dict[str, int]]:
    """(load(names), sizes): base weights from safetensors with (alpha / rank) · B A merged into adapted ones;
    `base_as_trained` (QLoRA): the adapted base weights NF4-rounded first, as the run trained on them. A
    DeepSeek base's per-expert weights are read as our stacks (routed experts carry no adapters: they are no
    Linear of ours) and written back per expert; the selection bias stays fp32, as `export_hf` writes it."""
    files = weight_files(base)
    scale = spec.finetune.lora.alpha / spec.finetune.lora.rank
    tie = model_args_from_spec(spec.model, max_seq_len=1).shape.tie_embeddings
    sizes: dict[str, int] = {}
    experts: dict[str, dict[int, str]] = {}
    for hf_name, file in files.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        stacked = from_hf_expert_name(hf_name)
        name = stacked[0] if stacked else from_hf_name(hf_name)
        if tie and name == "output.weight":
            continue
        if stacked:
            experts.setdefault(name, {})[stacked[1]] = hf_name
        with open_weights(file) as handle:
            shape = handle.get_slice(hf_name).get_shape()
        sizes[name] = sizes.get(name, 0) + int(torch.Size(shape).numel()) * dtype.itemsize
    by_expert = {name: [members[e] for e in sorted(members)] for name, members in experts.items()}

    def load(group: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in group:
            weight = _base_tensor(files, name, by_expert).float()
            prefix = name.removesuffix(".weight")
            if f"{prefix}.lora_a" in dcp_tensors.meta:
                if base_as_trained:  # QLoRA quantised exactly the adapted Linears' weights (model/lora.py)
                    weight = nf4_round(weight)
                adapters = dcp_tensors.load([f"{prefix}.lora_a", f"{prefix}.lora_b"], dtype=torch.float32)
                weight = weight + scale * (adapters[f"{prefix}.lora_b"] @ adapters[f"{prefix}.lora_a"])
            out[name] = weight if name.endswith("expert_bias") else weight.to(dtype)
        return out

    return load, sizes


def _copy_tokenizer(spec: JobSpec, out: Path) -> str:
    """Copy the model's tokenizer files, else the data dir's tokenizer.json; "" or why none was found."""
    source = Path(spec.model.init_from) if spec.model.init_from else None
    copied = False
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
                copied = copied or name == "tokenizer.json"
    data_tokenizer = Path(spec.data.dir) / "tokenizer.json"
    if not copied and data_tokenizer.is_file():
        shutil.copy2(data_tokenizer, out / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": spec.data.tokenizer.eos_token}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return "" if copied or data_tokenizer.is_file() else (
        f"no tokenizer.json in {' or '.join(str(p) for p in (source, Path(spec.data.dir)) if p is not None)}")


def _write_adapter(spec: JobSpec, dcp_tensors: DcpTensors, out: Path, *, base: Path) -> int:
    """A PEFT LoRA adapter: lora_A (rank, in) and lora_B (out, rank) under PEFT's module names. target_modules
    are the short names (`q_proj`) when each names only adapted modules of the base, else the adapted modules'
    full names. Our LoRA never adapts routed experts (stacked tensors, no Linear); on a DeepSeek MoE base PEFT
    (>= 0.18 with transformers 5) rewrites any `*.gate_proj|up_proj|down_proj` target, shared experts' and the
    dense layers' too, into the fused routed-expert parameters, and the router is no Linear there: such
    adapters are refused by name rather than written as an adapter that would load onto the wrong weights."""
    names = sorted(n for n in dcp_tensors.meta if is_adapter(n))
    prefixes = sorted({n.rsplit(".", 1)[0] for n in names})
    modules = {p: to_hf_name(f"{p}.weight").removesuffix(".weight") for p in prefixes}
    base_files = weight_files(base)  # read once: the MoE test below and target_modules both need its names
    moe_base = any(from_hf_expert_name(n) for n in base_files)
    unmapped = [p for p, m in modules.items() if p.endswith("router.gate") or (
        moe_base and m.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj"))]
    if unmapped:
        shown = ", ".join(unmapped[:4]) + (f" and {len(unmapped) - 4} more" if len(unmapped) > 4 else "")
        raise UserInputError(f"--adapter-only: a PEFT adapter cannot hold the LoRA on {shown} (on a DeepSeek MoE "
                             "model PEFT moves every *_proj MLP target onto the routed experts, and the router is "
                             "no Linear); export merged (without --adapter-only) or train attention-only targets")
    tensors = {}
    for name, tensor in dcp_tensors.load(names, dtype=torch.float32).items():
        prefix, which = name.rsplit(".", 1)
        tensors[f"base_model.model.{modules[prefix]}.lora_{which[-1].upper()}.weight"] = tensor.contiguous()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    lora = spec.finetune.lora
    adapted = set(modules.values())
    short = {m.rsplit(".", 1)[-1] for m in adapted}
    base_modules = {n.removesuffix(".weight") for n in base_files if n.endswith(".weight")}
    exact = all(m in adapted for m in base_modules if m.rsplit(".", 1)[-1] in short)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
              "target_modules": sorted(short if exact else adapted),
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return len(tensors)


def export_run(
    run_dir: Path, out_dir: Path, *, step: int | None = None, adapter_only: bool = False,
    dtype: torch.dtype = torch.float32, base_as_trained: bool = False,
) -> ExportResult:
    """Export RUN_DIR's checkpoint (newest committed, or `step`) to `out_dir` as a HF directory;
    `base_as_trained`: a QLoRA run merged onto its NF4-rounded base (what it trained against)."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    spec_path = run_dir / "spec.yaml"
    if not spec_path.is_file():
        raise UserInputError(f"{run_dir}: no spec.yaml (not a run dir written by `leantrain train`)")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserInputError(f"--out {out_dir}: exists and is not empty (nothing was written)")
    spec = load_spec(spec_path)
    dcp_tensors = DcpTensors(spec, run_dir, step=step)
    lora = any(is_adapter(n) for n in dcp_tensors.meta)
    if adapter_only and not lora:
        raise UserInputError(f"--adapter-only: the checkpoint in {run_dir} has no LoRA adapters (task "
                             f"{spec.task}, finetune.method {spec.finetune.method})")
    if base_as_trained:
        check_base_as_trained(spec, run_dir)
        if adapter_only:
            raise UserInputError("--base-as-trained rounds the base of a merged export; a PEFT adapter "
                                 "(--adapter-only) carries no base")
    args = model_args_from_spec(spec.model, max_seq_len=spec.data.seq_len)
    base_config = (json.loads((Path(spec.model.init_from) / CONFIG_FILE).read_text(encoding="utf-8"))
                   if spec.model.init_from else None)
    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if lora:
            base = verify_base(run_dir)
        if adapter_only:
            count = _write_adapter(spec, dcp_tensors, tmp, base=base)
        else:
            if lora:
                load, sizes = _lora_loader(spec, dcp_tensors, base, dtype, base_as_trained=base_as_trained)
            else:
                sizes = dcp_tensors.sizes()

                def load(group: list[str]) -> dict[str, torch.Tensor]:
                    return dcp_tensors.load(group, dtype=dtype)
            write_hf_shards(tmp, shards=plan_shards(sizes), load=load,
                            config=hf_config(args, dtype=dtype, base=base_config))
            count = len(sizes)
        no_tokenizer = _copy_tokenizer(spec, tmp)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out_dir=out_dir, step=dcp_tensors.entry.step, num_tensors=count, merged_lora=lora and not
                        adapter_only, adapter_only=adapter_only, no_tokenizer=no_tokenizer)


def check_base_as_trained(spec: JobSpec, run_dir: Path) -> None:
    """`--base-as-trained` is for QLoRA runs (their base was trained in NF4); anything else is refused."""
    if spec.task != "finetune" or spec.finetune.weights != "qlora":
        raise UserInputError(f"--base-as-trained: {run_dir} is not a QLoRA run (finetune weights "
                             f"{spec.finetune.weights}): its base was trained as stored, there is nothing to round")


def run(*, console: Any, run_dir: Path, out: Path, step: int | None, adapter_only: bool,
        base_as_trained: bool = False) -> None:
    """The `leantrain export` command."""
    result = export_run(run_dir, out, step=step, adapter_only=adapter_only, base_as_trained=base_as_trained)
    what = ("a PEFT LoRA adapter" if result.adapter_only else
            "a Hugging Face model (LoRA merged)" if result.merged_lora else "a Hugging Face model")
    console.print(f"[green]exported[/green] step {result.step} of {run_dir} as {what}: {result.num_tensors} "
                  f"tensors in {result.out_dir}", highlight=False)
    if result.no_tokenizer:
        from rich.markup import escape

        console.print(f"[yellow]warning:[/yellow] {escape(result.no_tokenizer)}: the model dir has no tokenizer (copy "
                      "one in, or export again with the data dir in place)", highlight=False)
