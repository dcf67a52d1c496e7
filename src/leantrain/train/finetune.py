"""Starting from a Hugging Face checkpoint: continued pre-training, full fine-tuning, LoRA and QLoRA (and DPO on
either kind of weights, `finetune.dpo.weights`: its objective is train/dpo.py).

The trainer calls three hooks, in its setup order:
  2. `prepare_model(model, spec)` on the meta-device model: LoRA/QLoRA swap the target Linears for
     `LoRALinear` and freeze everything else (model/lora.py);
  4. `weights_loader(spec)` is handed to `ParallelModel.initialize`: after `to_empty` every rank fills its
     own shards from `model.init_from`'s safetensors (model/hf_load.py), the adapters get their init by name
     (same values whatever the layout), and QLoRA quantises the frozen base to NF4;
  when training starts, the ranks hash the base's files together (each file by one rank, `base_share`) and rank 0
     writes `base_model.json` (`record_base`, ckpt/base_ref.py, from train/run_setup.py's `record_ranks_joined`):
     the init_from path and the sha256 of each of its files. A LoRA checkpoint holds only the adapters and their
     optimizer state (frozen parameters are left out of DCP's state dict, ckpt/dcp_io.py), so the base is
     referenced by these hashes, not copied; export checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantrain.errors import UserInputError
from leantrain.model.hf_load import check_hf_dir, fill_from_hf
from leantrain.model.init import fill_parameter, param_seed
from leantrain.model.lora import apply_lora, init_adapter, is_adapter, quantize_base
from leantrain.model.transformer import model_args_from_spec
from leantrain.rank0 import from_rank0
from leantrain.spec.schema import JobSpec


def uses_adapters(spec: JobSpec) -> bool:
    """LoRA or QLoRA adapters: finetune.method lora/qlora, or dpo with finetune.dpo.weights lora/qlora."""
    return spec.task == "finetune" and spec.finetune.weights in ("lora", "qlora")


def prepare_model(model: nn.Module, spec: JobSpec) -> None:
    """On the meta-device model, before parallelize: LoRA adapters on the targets, the rest frozen."""
    if not uses_adapters(spec):
        return
    lora = spec.finetune.lora
    try:
        apply_lora(model, targets=lora.targets, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
    except ValueError as err:
        raise UserInputError(str(err)) from err


def weights_loader(spec: JobSpec) -> Callable[[Any], None] | None:
    """The `load` for `ParallelModel.initialize` when the spec starts from a checkpoint (None otherwise)."""
    hf_dir = spec.model.init_from
    if hf_dir is None:
        if spec.task != "pretrain":
            raise UserInputError(f"task {spec.task} trains from existing weights: set model.init_from to a Hugging "
                                 "Face checkpoint dir (plan works without it)")
        return None
    args = model_args_from_spec(spec.model, max_seq_len=spec.data.seq_len)
    # names and shapes from the headers, before anything is allocated: by rank 0 alone, the result broadcast
    owners = from_rank0(partial(check_hf_dir, Path(hf_dir), args=args))
    seed, qlora = spec.training.seed, uses_adapters(spec) and spec.finetune.weights == "qlora"

    @torch.no_grad()
    def load(parallel: Any) -> None:
        if qlora and parallel.mesh is not None:
            raise UserInputError("finetune.method qlora runs in one process for now (the NF4 base is not sharded "
                                 "across ranks); use method lora with FSDP for several ranks")
        for part in parallel.parts:
            fill_from_hf(part, Path(hf_dir), args=args, skip=is_adapter, owners=owners)
            for name, param in part.named_parameters():
                if is_adapter(name):
                    fill_parameter(param, partial(init_adapter, name), seed=param_seed(seed, name))
            if qlora:
                quantize_base(part)

    return load


def param_counts(model: nn.Module) -> dict[str, int]:
    """`params` (all, tied once) and `trainable_params` (those the optimizer steps)."""
    params = list(model.parameters())
    return {"params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad)}
