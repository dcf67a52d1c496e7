"""RoPE frequencies with the scalings Hugging Face checkpoints use: none, linear (position interpolation),
Llama 3.1's wavelength-dependent rule and YaRN (DeepSeek-V2/V3's long-context configs), computed as
transformers computes them so loaded models match; and the two ways of applying them: rotate-half (Llama,
Hugging Face) and interleaved pairs (DeepSeek).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(
    *, head_dim: int, theta: float, scaling: tuple[tuple[str, Any], ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The (head_dim / 2,) inverse frequencies, scaled per `scaling` ((key, value) pairs with `rope_type`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    params = dict(scaling)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, params)
    if rope_type == "yarn":
        return _yarn(inv_freq, params, head_dim=head_dim, theta=theta)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: tuple[tuple[str, Any], ...] | None) -> float:
    """YaRN's multiplier on cos/sin (1 for every other RoPE): the config's `attention_factor`, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), else mscale(factor) (Peng et al. 2023, §3.4)."""
    params = dict(scaling or ())
    if params.get("rope_type") != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return _yarn_mscale(factor, float(params["mscale"])) / _yarn_mscale(factor, float(params["mscale_all_dim"]))
    return _yarn_mscale(factor)


def softmax_scale_factor(scaling: tuple[tuple[str, Any], ...] | None) -> float:
    """DeepSeek's extra softmax-scale multiplier under YaRN, mscale(factor, mscale_all_dim)² (its attention
    code; 1 without YaRN or without mscale_all_dim)."""
    params = dict(scaling or ())
    if params.get("rope_type") != "yarn" or not params.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2


def _yarn(inv_freq: torch.Tensor, params: dict[str, Any], *, head_dim: int, theta: float) -> torch.Tensor:
    """YaRN (Peng et al. 2023, arXiv 2309.00071): per dimension, a linear ramp between interpolated (÷ factor)
    and original frequencies over the dimensions whose wavelength the original context holds beta_slow..
    beta_fast times, as transformers' `_compute_yarn_parameters` computes it."""
    factor = float(params["factor"])
    old_context = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolate), 0: interpolated
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, a smooth blend in between (Llama 3.1)."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_interleaved(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs of (..., seq, dim), with the rotate-half tables of `rope_tables` (2, seq, dim):
    pair i turns by angle i, whose cos/sin sit in the tables' first dim / 2 columns. Computed in fp32."""
    seq_len, dim = x.shape[-2], x.shape[-1]
    cos, sin = tables[0, :seq_len, : dim // 2], tables[1, :seq_len, : dim // 2]
    pairs = x.float().unflatten(-1, (dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def rotate_half(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama's layout) of (..., seq, dim) by the first `seq` rows of the tables."""
    seq_len = x.shape[-2]
    cos, sin = tables[0, :seq_len].to(x.dtype), tables[1, :seq_len].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
