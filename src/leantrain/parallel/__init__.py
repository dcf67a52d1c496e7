"""Parallelism on one device mesh: FSDP2, tensor, pipeline and expert parallel (docs/parallel.md)."""

from leantrain.parallel.comm import CommTimer
from leantrain.parallel.dims import ParallelDims
from leantrain.parallel.parallelize import ParallelModel, parallelize

__all__ = ["CommTimer", "ParallelDims", "ParallelModel", "parallelize"]
