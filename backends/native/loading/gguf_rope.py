"""Llama 3's RoPE scaling from a GGUF file. llama.cpp's converter writes it as no metadata at
all, only a `rope_freqs.weight` tensor: one factor a rotary frequency, each frequency divided
by its factor (1 for the high frequencies, `factor` for the low ones, a smooth blend between).

The native Llama builds its rotary from transformers' `rope_parameters`, so the factors go back
into llama3 parameters that give the same frequencies: the blend is linear in 1 / wavelength,
`smooth = (original / wavelen - low) / (high - low)`, so two blended frequencies fix it (with
`low_freq_factor` 1, the scale the formula leaves free: Llama 3's own values come back). With
one or none blended, any band edges between the neighbouring frequencies give the same
frequencies, and some are picked. Either way the result is checked against the file's factors
(`inv_freq / factors`, what llama.cpp computes), and factors no llama3 parameters reproduce are
refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backends.native.models.support import UnsupportedModelError

ROPE_FREQS = "rope_freqs.weight"
# float32 factors and frequencies: the file's factors and transformers' own arithmetic round
# apart by a few float32 ulps; a wrong band or blend is off by far more.
FREQUENCY_TOLERANCE = 1e-5
_SAME = 1e-6  # relative: a factor at 1 or at `factor` exactly, up to float32 rounding


def llama3_rope_scaling(
    factors: torch.Tensor, rope_theta: float, rotary_dim: int, context_length: int,
) -> dict[str, Any] | None:
    """The llama3 `rope_scaling` whose frequencies are `base frequencies / factors`; None
    when every factor is 1 (plain RoPE)."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64)
                                      / rotary_dim))
    f = factors.double().flatten()
    if f.numel() != inv_freq.numel():
        raise UnsupportedModelError(
            f"GGUF {ROPE_FREQS} has {f.numel()} factors for {inv_freq.numel()} frequencies.")
    factor = float(f.max())
    if math.isclose(factor, 1.0, rel_tol=_SAME) and math.isclose(float(f.min()), 1.0,
                                                                rel_tol=_SAME):
        return None
    wavelen = 2 * math.pi / inv_freq
    original, high = _band_edges(wavelen, f, factor)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": high, "original_max_position_embeddings": original}
    _check(scaling, inv_freq / f, rope_theta, rotary_dim, context_length)
    return scaling


def _band_edges(wavelen: torch.Tensor, f: torch.Tensor, factor: float) -> tuple[float, float]:
    """(original_max_position_embeddings, high_freq_factor) with low_freq_factor 1."""
    kept = torch.isclose(f, torch.ones_like(f), rtol=_SAME, atol=0)
    divided = torch.isclose(f, torch.full_like(f, factor), rtol=_SAME, atol=0)
    blended = ~kept & ~divided
    longest_kept = float(wavelen[kept].max()) if kept.any() else 0.0
    shortest_divided = float(wavelen[divided].min()) if divided.any() else math.inf
    # The blend's position in [0, 1]: 1 / f = (1 - smooth) / factor + smooth.
    smooth = (1 / f[blended] - 1 / factor) / (1 - 1 / factor)
    if blended.sum() >= 2:  # smooth = a / wavelen + b, a = original / (high - 1), b = -1 / (...)
        design = torch.stack((1 / wavelen[blended], torch.ones_like(smooth)), dim=1)
        a, b = torch.linalg.lstsq(design, smooth.unsqueeze(1)).solution.flatten().tolist()
        return _tidy(-a / b), _tidy(1 - 1 / b)
    if blended.sum() == 1:  # any original past it (and before the divided) with its high
        one = float(wavelen[blended])
        original = math.sqrt(one * min(shortest_divided, 4 * one))
        return original, 1 + (original / one - 1) / float(smooth)
    original = shortest_divided if math.isfinite(shortest_divided) else 2 * longest_kept
    return original, original / math.sqrt(max(longest_kept, 1e-9) * original)


def _tidy(value: float) -> float:
    """A fitted value as the config had it (Llama 3's 8192 and 4.0) where it is that close to
    a round one; the check below still holds the frequencies to the file's."""
    for digits in (0, 3):
        rounded = round(value, digits)
        if abs(value - rounded) < 1e-5 * abs(value):
            return rounded
    return value


def _check(scaling: dict[str, Any], want: torch.Tensor, rope_theta: float, rotary_dim: int,
           context_length: int) -> None:
    """Refuse parameters whose frequencies (transformers' float32 llama3) are not the file's."""

    class Config:  # what transformers' llama3 init reads
        head_dim = rotary_dim
        hidden_size = rotary_dim
        num_attention_heads = 1
        max_position_embeddings = context_length
        rope_parameters = {**scaling, "rope_theta": rope_theta}

        def standardize_rope_params(self) -> None:
            pass

    got, _ = ROPE_INIT_FUNCTIONS["llama3"](Config(), "cpu")
    if not torch.allclose(got.double(), want, rtol=FREQUENCY_TOLERANCE, atol=0):
        raise UnsupportedModelError(
            f"GGUF {ROPE_FREQS}: these frequency factors are not llama3 RoPE scaling.")
