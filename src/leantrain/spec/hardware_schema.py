"""The `hardware` section: the accelerator from the catalog, its count and links, and memory with its unit."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from leantrain.hardware import CATALOG, accelerator_names, canonical_name
from leantrain.spec.base import PositiveInt, Section


class HardwareSpec(Section):
    """The cluster: accelerator model from the catalog and its count and links."""

    accelerator: str = Field("H100-SXM", description=f"One of: {', '.join(accelerator_names())}.")
    gpus_per_node: PositiveInt = Field(8, description="Accelerators per node.")
    num_nodes: PositiveInt | None = Field(None, description="Nodes; None lets the planner choose.")
    peak_flops: float | None = Field(
        None, gt=0, description="Override the catalog's dense peak FLOP/s per GPU for the compute dtype."
    )
    memory_gb: float | str | None = Field(
        None, description="Override the catalog's memory per GPU in decimal GB (1e9 bytes), or with its unit: "
        "\"96 GB\", \"96 GiB\". A bare whole number is refused as ambiguous (vendors' \"80GB\" is 80 GiB): "
        "write the unit, or use memory_gib."
    )
    memory_gib: float | None = Field(
        None, gt=0, description="Override the catalog's memory per GPU in GiB (2^30 bytes)."
    )
    power_w: float | None = Field(
        None, gt=0, description="Board power limit per GPU in W (nvidia-smi -pl); below the accelerator's TDP the "
        "planner lowers the sustained matmul rate (docs/plan.md); above it, refused. Default: the catalog's "
        "(H100-HBM2e: 500 W)."
    )
    intra_node_bandwidth_gb_s: float | None = Field(
        None, gt=0, description="GPU-to-GPU bandwidth inside a node, GB/s per direction (catalog default)."
    )
    inter_node_bandwidth_gb_s: float | None = Field(
        None, gt=0, description="Per-GPU bandwidth across nodes, GB/s per direction (catalog default)."
    )

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, name: str) -> str:
        canon = canonical_name(name)
        if canon is None:
            raise ValueError(f"unknown accelerator {name!r}; allowed: {', '.join(accelerator_names())}")
        return canon

    @field_validator("memory_gb", mode="before")
    @classmethod
    def _memory_with_unit(cls, value: object) -> float | None:
        return parse_memory_gb(value)

    @model_validator(mode="after")
    def _one_memory_override(self) -> HardwareSpec:
        if self.memory_gb is not None and self.memory_gib is not None:
            raise ValueError("give memory_gb or memory_gib, not both")
        return self

    @model_validator(mode="after")
    def _power_within_tdp(self) -> HardwareSpec:
        tdp = CATALOG[self.accelerator].tdp_w
        if self.power_w is not None and tdp is not None and self.power_w > tdp:
            raise ValueError(f"power_w ({self.power_w:g} W) is above {self.accelerator}'s {tdp:g} W TDP, which no "
                             "power limit can exceed: leave power_w unset to plan at the TDP, or give the limit "
                             "nvidia-smi -q -d POWER shows")
        return self

    @property
    def memory_bytes(self) -> float | None:
        """The memory override in bytes (None: the catalog's)."""
        if self.memory_gib is not None:
            return self.memory_gib * 2**30
        return None if self.memory_gb is None else float(self.memory_gb) * 1e9

    @property
    def num_gpus(self) -> int | None:
        return None if self.num_nodes is None else self.num_nodes * self.gpus_per_node


def parse_memory_gb(value: object, *, gib_field: str = "memory_gib") -> float | None:
    """`hardware.memory_gb` (or `cluster.memory_gb_per_node`) → decimal GB: a number with a fractional part as GB,
    "N GB" / "N GiB" by its unit; a bare whole number is refused, naming both readings (GPU memory is sold as
    "80GB" and is 80 GiB; Slurm's --mem=512G and Kubernetes' 512Gi are GiB) and the GiB field."""
    if value is None:
        return None
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GB|GiB)\s*", value, flags=re.IGNORECASE)
        if match is None:
            raise ValueError(f"{value!r}: write a number with GB or GiB, e.g. \"96 GiB\"")
        number, unit = float(match.group(1)), match.group(2).lower()
        gb = number * 2**30 / 1e9 if unit == "gib" else number
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = gb = float(value)
        if number.is_integer() and number >= 1:
            raise ValueError(f"{value:g} is ambiguous: {number:g} GB = {number * 1e9 / 2**30:.1f} GiB, or "
                             f"{number:g} GiB = {number * 2**30 / 1e9:.1f} GB (the catalog's unit); write "
                             f"\"{value:g} GB\" or \"{value:g} GiB\", or use {gib_field}: {value:g}")
    else:
        raise ValueError(f"{value!r}: a number of GB or a string with its unit, e.g. \"96 GiB\"")
    if gb <= 0:
        raise ValueError("must be positive")
    return gb
