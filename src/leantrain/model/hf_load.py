"""Load a Hugging Face safetensors checkpoint straight into a (possibly sharded) model: each rank reads only its slice.

`fill_from_hf(module, hf_dir, args=...)` takes the model after parallelize and `to_empty` (parameters are
DTensors under FSDP2/TP, plain tensors in one process; pipeline stages keep the single-process names) and
fills every parameter from the checkpoint: for a DTensor it computes this rank's
shape and global offset from the placements and reads exactly that box with safetensors' lazy `get_slice`,
so no rank ever holds a full copy of the model, or even of one weight it only holds a shard of. Buffers
(RoPE tables) are computed, not read (`ParallelModel.initialize` fills them before calling the loader).

Before any data is read, the checkpoint's names and shapes are checked against the model: an unknown or
missing tensor, or a shape that differs, is a UserInputError naming the file and the tensor; so is a file whose
header does not parse or does not account for the file's size (a download cut short), found by opening it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from leantrain.errors import UserInputError
from leantrain.model.hf import (
    INDEX_FILE,
    WEIGHTS_FILE,
    args_from_hf_config,
    expert_hf_name,
    from_hf_expert_name,
    from_hf_name,
    hf_layer,
    is_expert_stack,
    to_hf_name,
)
from leantrain.model.init import init_buffers
from leantrain.model.layers import ModelArgs
from leantrain.model.transformer import Transformer
from leantrain.spec.hf_config import read_hf_config

# Tensors some exports carry that our model derives (RoPE inverse frequencies).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def open_weights(file: Path) -> Any:
    """`safe_open` of one safetensors file: reads its header and checks that the tensors it lists cover the file
    exactly, without reading the weights. A damaged or cut-short file (or one that cannot be opened) is a
    UserInputError naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as err:
        size = f"; the file has {file.stat().st_size:,} bytes" if file.is_file() else ""
        raise UserInputError(f"{file}: not a readable safetensors file ({err}{size}), perhaps a download cut "
                             "short: download it again") from None
    except OSError as err:
        raise UserInputError(f"{file}: cannot be read as a safetensors file ({err.strerror or err})") from None


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
        with open_weights(file) as handle:
            mapping.update({name: file for name in handle.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return mapping


Owner = Path | list[Path]  # the file holding a tensor, or one per expert for a stack of routed experts


def _checkpoint_shapes(files: dict[str, Path], *, mtp_from: int | None = None) -> dict[str, tuple[Owner, tuple]]:
    """Our name -> (file, shape) for every tensor, reading only the safetensors headers. Per-expert HF weights
    (out, in) are gathered into our stacked (experts, in, out) shape, with the file of each expert. Layers from
    `mtp_from` on are DeepSeek-V3's multi-token-prediction modules, which the model does not have (skipped, as
    transformers skips them)."""
    shapes: dict[str, tuple[Owner, tuple[int, ...]]] = {}
    experts: dict[str, dict[int, tuple[Path, tuple[int, ...], str]]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        if not file.is_file():
            raise UserInputError(f"{file}: listed in {INDEX_FILE} but missing")
        with open_weights(file) as handle:
            for name in names:
                if name.endswith(_DERIVED_SUFFIXES) or _is_mtp(name, mtp_from):
                    continue
                shape = tuple(handle.get_slice(name).get_shape())
                stacked = from_hf_expert_name(name)
                if stacked is not None:
                    experts.setdefault(stacked[0], {})[stacked[1]] = (file, shape, name)
                    continue
                try:
                    ours = from_hf_name(name)
                except KeyError:
                    raise UserInputError(f"{file}: tensor {name!r} has no counterpart in this model "
                                         "(unsupported architecture or a config.json that does not match)") from None
                shapes[ours] = (file, shape)
    for ours, members in experts.items():
        shapes[ours] = _stack_shape(members)
    return shapes


def _is_mtp(name: str, mtp_from: int | None) -> bool:
    layer = hf_layer(name)
    return mtp_from is not None and layer is not None and layer >= mtp_from


def _stack_shape(members: dict[int, tuple[Path, tuple[int, ...], str]]) -> tuple[list[Path], tuple[int, ...]]:
    """The files and the stacked (experts, in, out) shape of one layer's per-expert weights, checked whole."""
    count = max(members) + 1
    absent = sorted(set(range(count)) - set(members))
    if absent:
        file, _, name = members[min(members)]
        raise UserInputError(f"{file.parent}: the checkpoint lacks expert {absent[0]} of {name!r}'s layer "
                             f"(experts 0..{count - 1} expected)")
    first = members[0][1]
    for file, shape, name in members.values():
        if shape != first or len(shape) != 2:
            raise UserInputError(f"{file}: tensor {name!r} has shape {list(shape)}, unlike expert 0's {list(first)}")
    return [members[e][0] for e in range(count)], (count, first[1], first[0])


def _display_name(name: str) -> str:
    return expert_hf_name(name, 0) if is_expert_stack(name) else to_hf_name(name)


def check_names_and_shapes(
    expected: dict[str, tuple[int, ...]], files: dict[str, Path], *, tie_embeddings: bool,
    mtp_from: int | None = None,
) -> dict[str, Owner]:
    """Compare the model's tensor shapes (single-process names) with the checkpoint's; our name -> file(s)."""
    found = _checkpoint_shapes(files, mtp_from=mtp_from)
    if tie_embeddings:
        found.pop("output.weight", None)  # some tied exports still write the head
    hf_dir = next(iter(files.values())).parent if files else Path(".")
    missing = sorted(set(expected) - set(found))
    if missing:
        raise UserInputError(f"{hf_dir}: the checkpoint lacks {_display_name(missing[0])!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                             + " (config.json and the safetensors files do not match)")
    extra = sorted(set(found) - set(expected))
    if extra:
        owner = found[extra[0]][0]
        raise UserInputError(f"{owner[0] if isinstance(owner, list) else owner}: tensor "
                             f"{_display_name(extra[0])!r} is not in the model "
                             "(config.json and the safetensors files do not match)")
    for name, shape in expected.items():
        owner, theirs = found[name]
        if theirs != shape:
            where = owner[0] if isinstance(owner, list) else owner
            raise UserInputError(f"{where}: tensor {_display_name(name)!r} has shape {list(theirs)}, but "
                                 f"config.json implies {list(shape)}")
    return {name: owner for name, (owner, _) in found.items()}


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the global tensor this rank holds (everything for a plain tensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, local_shape, strict=True))


@torch.no_grad()
def fill_from_hf(
    module: nn.Module, hf_dir: Path, *, args: ModelArgs, skip: Callable[[str], bool] = lambda name: False,
    owners: Mapping[str, str | list[str]] | None = None,
) -> int:
    """Fill the (allocated) parameters of `module` from `hf_dir`, each rank its own slices; returns bytes read.

    `module` is the model or a pipeline stage after parallelize and `to_empty`; `skip(name)` marks parameters
    that are not in the checkpoint (LoRA adapters), left for the caller to fill. `owners` (our name → file
    name(s), from `check_hf_dir`, e.g. checked once by rank 0 and broadcast): the headers are not read again and
    only the files holding this module's tensors are opened (a pipeline stage opens its layers' files; an
    expert-parallel rank the files of its experts). A DeepSeek-V3 checkpoint's selection bias is read too.
    """
    tensors = {name: p for name, p in _loadable(module, args) if not skip(name)}
    if owners is not None:
        missing = sorted(set(tensors) - set(owners))
        if missing:
            raise UserInputError(f"{hf_dir}: the checkpoint lacks {_display_name(missing[0])!r}")
        files_of: dict[str, Owner] = {
            name: [Path(hf_dir) / f for f in owners[name]] if isinstance(owners[name], list)
            else Path(hf_dir) / owners[name] for name in tensors}  # type: ignore[operator]
    else:
        files = weight_files(Path(hf_dir))
        expected = {name: tuple(p.shape) for name, p in tensors.items()}
        mtp_from = _mtp_from(Path(hf_dir))
        if _is_stage(module, args):
            files_of = check_names_and_shapes(expected, _restrict(files, tensors), tie_embeddings=False)
        else:
            files_of = check_names_and_shapes(expected, files, tie_embeddings=args.shape.tie_embeddings,
                                              mtp_from=mtp_from)
    reader = _Reader()
    try:
        for name, tensor in tensors.items():
            box = local_box(tensor)
            owner = files_of[name]
            if isinstance(owner, list):  # (experts, in, out) from each expert's (out, in) weight
                experts = range(box[0].start, box[0].stop)
                piece = torch.stack([reader.read(owner[e], expert_hf_name(name, e), (box[2], box[1])).t()
                                     for e in experts]) if len(experts) else torch.empty(0)
            else:
                piece = reader.read(owner, to_hf_name(name), box)
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local.copy_(piece.reshape(local.shape).to(device=local.device, dtype=local.dtype))
    finally:
        reader.close()
    return reader.bytes


class _Reader:
    """Lazily opened safetensors files, and the bytes read from them."""

    def __init__(self) -> None:
        self.handles: dict[Path, Any] = {}
        self.bytes = 0

    def read(self, file: Path, hf_name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if file not in self.handles:  # its header was checked at start, but the file may have changed since
            self.handles[file] = open_weights(file).__enter__()
        piece = self.handles[file].get_slice(hf_name)[box]
        self.bytes += piece.numel() * piece.element_size()
        return piece

    def close(self) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)


def _loadable(module: nn.Module, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """The tensors a checkpoint fills: every parameter, and the selection bias when the routing uses one."""
    tensors = list(module.named_parameters())
    if args.balance == "aux_free":
        tensors += [(name, b) for name, b in module.named_buffers() if name.endswith("expert_bias")]
    return tensors


def _mtp_from(hf_dir: Path) -> int | None:
    """First layer index of DeepSeek-V3's multi-token-prediction modules in the files, None without them."""
    config = read_hf_config(hf_dir)
    return config.n_layers if config.mtp_layers else None


def check_hf_dir(hf_dir: Path, *, args: ModelArgs) -> dict[str, str | list[str]]:
    """Names and shapes of `hf_dir` against the model `args` describes, reading only headers (before any rank
    allocates anything); returns our name → the file(s) (names in `hf_dir`) holding it, for `fill_from_hf`."""
    with torch.device("meta"):
        model = Transformer(args)
    expected = {name: tuple(p.shape) for name, p in _loadable(model, args)}
    found = check_names_and_shapes(expected, weight_files(Path(hf_dir)), tie_embeddings=args.shape.tie_embeddings,
                                   mtp_from=_mtp_from(Path(hf_dir)))
    return {name: [p.name for p in owner] if isinstance(owner, list) else owner.name for name, owner in found.items()}


def _is_stage(module: nn.Module, args: ModelArgs) -> bool:
    """A pipeline stage holds only some layers: check just the names it has."""
    layers = getattr(module, "layers", None)
    return layers is not None and len(layers) != args.shape.n_layers


def _restrict(files: dict[str, Path], params: dict[str, torch.Tensor]) -> dict[str, Path]:
    wanted = {to_hf_name(name) for name in params if not is_expert_stack(name)}
    stacks = {name for name in params if is_expert_stack(name)}
    return {name: file for name, file in files.items()
            if name in wanted or (from_hf_expert_name(name) or ("",))[0] in stacks}


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
