"""Load a Hugging Face safetensors checkpoint straight into a (possibly sharded) model: each rank reads only its slice.

`fill_from_hf(module, hf_dir, args=...)` takes the model after parallelize and `to_empty` (parameters are
DTensors under FSDP2/TP, plain tensors in one process; pipeline stages keep the single-process names) and
fills every parameter from the checkpoint: for a DTensor it computes this rank's
shape and global offset from the placements and reads exactly that box with safetensors' lazy `get_slice`,
so no rank ever holds a full copy of the model, or even of one weight it only holds a shard of. Buffers
(RoPE tables) are computed, not read (`ParallelModel.initialize` fills them before calling the loader).

Before any data is read, the checkpoint's names and shapes are checked against the model: an unknown or
missing tensor, or a shape that differs, is a UserInputError naming the file and the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from leantrain.errors import UserInputError
from leantrain.model.hf import INDEX_FILE, WEIGHTS_FILE, args_from_hf_config, from_hf_name, to_hf_name
from leantrain.model.init import init_buffers
from leantrain.model.layers import ModelArgs
from leantrain.model.transformer import Transformer

# Tensors some exports carry that our model derives (RoPE inverse frequencies).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, or the single file, or every file)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise UserInputError(f"{index}: not a safetensors index (field 'weight_map': {err})") from err
        return {name: hf_dir / file for name, file in weight_map.items()}
    files = [hf_dir / WEIGHTS_FILE] if (hf_dir / WEIGHTS_FILE).is_file() else sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise UserInputError(f"{hf_dir}: no *.safetensors files (model.init_from needs safetensors weights)")
    mapping: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            mapping.update({name: file for name in handle.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return mapping


def _checkpoint_shapes(files: dict[str, Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Our name -> (file, shape) for every tensor, reading only the safetensors headers."""
    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        if not file.is_file():
            raise UserInputError(f"{file}: listed in {INDEX_FILE} but missing")
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                if name.endswith(_DERIVED_SUFFIXES):
                    continue
                try:
                    ours = from_hf_name(name)
                except KeyError:
                    raise UserInputError(f"{file}: tensor {name!r} has no counterpart in this model "
                                         "(unsupported architecture or a config.json that does not match)") from None
                shapes[ours] = (file, tuple(handle.get_slice(name).get_shape()))
    return shapes


def check_names_and_shapes(
    expected: dict[str, tuple[int, ...]], files: dict[str, Path], *, tie_embeddings: bool
) -> dict[str, Path]:
    """Compare the model's parameter shapes (single-process names) with the checkpoint's; our name -> file."""
    found = _checkpoint_shapes(files)
    if tie_embeddings:
        found.pop("output.weight", None)  # some tied exports still write the head
    hf_dir = next(iter(files.values())).parent if files else Path(".")
    missing = sorted(set(expected) - set(found))
    if missing:
        raise UserInputError(f"{hf_dir}: the checkpoint lacks {to_hf_name(missing[0])!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                             + " (config.json and the safetensors files do not match)")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise UserInputError(f"{found[extra[0]][0]}: tensor {to_hf_name(extra[0])!r} is not in the model "
                             "(config.json and the safetensors files do not match)")
    for name, shape in expected.items():
        file, theirs = found[name]
        if theirs != shape:
            raise UserInputError(f"{file}: tensor {to_hf_name(name)!r} has shape {list(theirs)}, but config.json "
                                 f"implies {list(shape)}")
    return {name: file for name, (file, _) in found.items()}


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the global tensor this rank holds (everything for a plain tensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, local_shape, strict=True))


@torch.no_grad()
def fill_from_hf(
    module: nn.Module, hf_dir: Path, *, args: ModelArgs, skip: Callable[[str], bool] = lambda name: False,
    owners: Mapping[str, str] | None = None,
) -> int:
    """Fill the (allocated) parameters of `module` from `hf_dir`, each rank its own slices; returns bytes read.

    `module` is the model or a pipeline stage after parallelize and `to_empty`; `skip(name)` marks parameters
    that are not in the checkpoint (LoRA adapters), left for the caller to fill. `owners` (our name → file
    name, from `check_hf_dir`, e.g. checked once by rank 0 and broadcast): the headers are not read again and
    only the files holding this module's parameters are opened (a pipeline stage opens its layers' files).
    """
    params = {name: p for name, p in module.named_parameters() if not skip(name)}
    if owners is not None:
        missing = sorted(set(params) - set(owners))
        if missing:
            raise UserInputError(f"{hf_dir}: the checkpoint lacks {to_hf_name(missing[0])!r}")
        files_of = {name: Path(hf_dir) / owners[name] for name in params}
    else:
        files = weight_files(Path(hf_dir))
        expected = {name: tuple(p.shape) for name, p in params.items()}
        if _is_stage(module, args):
            files_of = check_names_and_shapes(expected, _restrict(files, params), tie_embeddings=False)
        else:
            files_of = check_names_and_shapes(expected, files, tie_embeddings=args.shape.tie_embeddings)
    read_bytes = 0
    handles: dict[Path, Any] = {}
    try:
        for name, param in params.items():
            file = files_of[name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            piece = handles[file].get_slice(to_hf_name(name))[local_box(param)]
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(piece.to(device=local.device, dtype=local.dtype))
            read_bytes += piece.numel() * piece.element_size()
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return read_bytes


def check_hf_dir(hf_dir: Path, *, args: ModelArgs) -> dict[str, str]:
    """Names and shapes of `hf_dir` against the model `args` describes, reading only headers (before any rank
    allocates anything); returns our name → the file (name in `hf_dir`) holding it, for `fill_from_hf`."""
    with torch.device("meta"):
        model = Transformer(args)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    found = check_names_and_shapes(expected, weight_files(Path(hf_dir)), tie_embeddings=args.shape.tie_embeddings)
    return {name: path.name for name, path in found.items()}


def _is_stage(module: nn.Module, args: ModelArgs) -> bool:
    """A pipeline stage holds only some layers: check just the names it has."""
    layers = getattr(module, "layers", None)
    return layers is not None and len(layers) != args.shape.n_layers


def _restrict(files: dict[str, Path], params: dict[str, torch.Tensor]) -> dict[str, Path]:
    wanted = {to_hf_name(name) for name in params}
    return {name: file for name, file in files.items() if name in wanted}


def import_hf(hf_dir: Path, *, device: torch.device | None = None, max_seq_len: int | None = None) -> Transformer:
    """Load a HF safetensors checkpoint into our model (fp32 parameters, one process)."""
    args = args_from_hf_config(Path(hf_dir), max_seq_len=max_seq_len)
    device = device or torch.device("cpu")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    init_buffers(model, args=args, device=device)
    fill_from_hf(model, Path(hf_dir), args=args)
    return model
