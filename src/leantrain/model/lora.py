"""Low-rank adapters: y = x Wᵀ + b + (alpha / rank) · dropout(x) Aᵀ Bᵀ on chosen Linear layers, the base W frozen.

`LoRALinear` subclasses `nn.Linear` and keeps its `weight`/`bias` where they were, so every name-based part of
the system sees the base unchanged: the Hugging Face loader (`layers.0.attention.wq.weight`), the init and
tensor-parallel plans, DCP, export. The adapters are two more parameters on the same module, `lora_a`
(rank, in) and `lora_b` (out, rank); FSDP2's per-block `fully_shard` shards them with the block (frozen and
trainable parameters in one group), so LoRA composes with FSDP/HSDP and pipeline stages. It is swapped in on
the meta device, before parallelize, like the fp8 swap.

QLoRA (`quantize_base`): the frozen base weight becomes torchao's NF4 tensor (4-bit NormalFloat with
double-quantised block scales, the QLoRA paper's format, as torchtune holds it); the forward dequantises
it block by block inside `F.linear`, the adapters stay in the master dtype (fp32) with their optimizer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
NF4_BLOCK = 64  # elements per NF4 scale (the QLoRA paper's block size)


def is_adapter(name: str) -> bool:
    """True for a LoRA adapter parameter's name (`layers.0.attention.wq.lora_a`)."""
    return name.endswith(ADAPTER_SUFFIXES)


class LoRALinear(nn.Linear):
    """A Linear with a frozen base and a trainable low-rank update (B starts at zero: the model is unchanged)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, rank: int, alpha: float,
                 dropout: float) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.rank, self.scale = rank, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)  # (..., out)
        update = F.linear(F.linear(self.dropout(x), self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))
        return base + self.scale * update

    def merged_weight(self) -> torch.Tensor:
        """W + scale · B A in fp32 (for export)."""
        weight = self.weight
        if hasattr(weight, "get_original_weight"):  # NF4: dequantised
            weight = weight.get_original_weight()
        return weight.float() + self.scale * (self.lora_b.float() @ self.lora_a.float())


def apply_lora(model: nn.Module, *, targets: list[str], rank: int, alpha: float, dropout: float) -> list[str]:
    """Swap every nn.Linear whose attribute name is in `targets` for a LoRALinear (in place, any device);
    freeze every other parameter. Returns the swapped modules' names; refuses targets that match nothing."""
    swapped: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name not in targets or type(child) is not nn.Linear:
                continue
            with torch.device(child.weight.device):  # on meta before parallelize: nothing is allocated
                lora = LoRALinear(child.in_features, child.out_features, bias=child.bias is not None, rank=rank,
                                  alpha=alpha, dropout=dropout)
            lora.weight, lora.bias = child.weight, child.bias
            lora.lora_a.data = lora.lora_a.data.to(child.weight.dtype)
            lora.lora_b.data = lora.lora_b.data.to(child.weight.dtype)
            setattr(parent, child_name, lora)
            swapped.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    unmatched = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name in swapped})
    if unmatched:
        linears = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m) is nn.Linear}
                         | {name.rsplit(".", 1)[-1] for name in swapped})
        raise ValueError(f"finetune.lora.targets: {', '.join(unmatched)} match no Linear layer of the model "
                         f"(its Linears: {', '.join(linears)})")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return swapped


def init_adapter(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """A: Kaiming-uniform (as nn.Linear and peft), B: zeros, so training starts from the base model exactly."""
    if name.endswith(".lora_b"):
        nn.init.zeros_(param)
    else:
        nn.init.kaiming_uniform_(param, a=math.sqrt(5), generator=generator)


def nf4_scaler_block(numel: int) -> int:
    """The largest power-of-two scaler block (≤ 256, torchao's default) that divides the number of NF4 blocks."""
    blocks = numel // NF4_BLOCK
    size = 256
    while size > 1 and blocks % size:
        size //= 2
    return size


@torch.no_grad()
def nf4_round(weight: torch.Tensor) -> torch.Tensor:
    """A base weight as QLoRA trains on it (`quantize_base`'s NF4 blocks), dequantised to fp32."""
    from torchao.quantization import to_nf4

    nf4 = to_nf4(weight.detach().to(torch.bfloat16), NF4_BLOCK, nf4_scaler_block(weight.numel()))
    return nf4.get_original_weight().float()


@torch.no_grad()
def quantize_base(model: nn.Module) -> int:
    """QLoRA: replace each LoRALinear's frozen base weight by an NF4 tensor; returns the bytes it now takes."""
    from torchao.quantization import to_nf4  # torchao is imported only by QLoRA runs

    total_bytes = 0
    for module in model.modules():
        if not isinstance(module, LoRALinear):
            continue
        weight = module.weight.detach()
        if weight.numel() % NF4_BLOCK:
            raise ValueError(f"finetune.method qlora: a {list(weight.shape)} weight is not a multiple of the "
                             f"NF4 block ({NF4_BLOCK} elements)")
        nf4 = to_nf4(weight.to(torch.bfloat16), NF4_BLOCK, nf4_scaler_block(weight.numel()))
        module.weight = nn.Parameter(nf4, requires_grad=False)
        total_bytes += weight.numel() // 2 + weight.numel() // NF4_BLOCK  # 4-bit codes + 8-bit block scales
    return total_bytes
