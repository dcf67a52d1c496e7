"""RoPE frequencies with the scalings Hugging Face checkpoints use: none, linear (position interpolation) and
Llama 3.1's wavelength-dependent rule, computed as transformers computes them so loaded models match.
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
    raise ValueError(f"unsupported rope_type {rope_type!r}")


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
