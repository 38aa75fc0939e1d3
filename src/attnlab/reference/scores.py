"""Scores and visibility as tensors: one definition each, shared by naive and tiled.

``scaled_scores`` applies the scale and then flash-attn's softcap,
``c * tanh(s / c)``, before any mask.  ``visible_keys``/``mask`` turn the
integer band of :mod:`attnlab.masking` into a boolean matrix.
"""

from __future__ import annotations

import torch

from attnlab.masking import KeyBand, shape_band
from attnlab.shapes import AttentionShape


def scaled_scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, softcap: float) -> torch.Tensor:
    """``scale * q @ k^T``, then ``softcap * tanh(scores / softcap)`` when softcap > 0."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    return scores


def visible_keys(band: KeyBand, query_rows: range, key_rows: range,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(len(query_rows), len(key_rows))``: True where the query row sees the key."""
    rows = torch.arange(query_rows.start, query_rows.stop, device=device).unsqueeze(1)
    cols = torch.arange(key_rows.start, key_rows.stop, device=device).unsqueeze(0)
    diagonal = cols - rows  # j - i: visibility is a band on this difference
    # Real rows and keys only; written so the result is always (rows, keys), band or not.
    visible = (rows >= 0) & (rows < band.seqlen_q) & (cols >= 0) & (cols < band.seqlen_k)
    if band.lowest is not None:
        visible = visible & (diagonal >= band.lowest)
    if band.highest is not None:
        visible = visible & (diagonal <= band.highest)
    return visible


def mask(seqlen_q: int, seqlen_k: int, *, causal: bool = False,
         window: tuple[int, int] = (-1, -1),
         device: torch.device | str | None = None) -> torch.Tensor:
    """The full ``(seqlen_q, seqlen_k)`` visible-key matrix (True = query may see key).

    Causal is bottom-right aligned: query i sees key j iff ``j <= i + seqlen_k - seqlen_q``;
    a window ``(left, right)`` keeps ``i + off - left <= j <= i + off + right`` (-1 unbounded).
    """
    # Building the shape validates the arguments with the messages every module gives.
    shape = AttentionShape(seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=causal,
                           window=tuple(window) if isinstance(window, list) else window)
    return shape_mask(shape, device=device)


def shape_mask(shape: AttentionShape, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`mask` for an :class:`AttentionShape`."""
    band = shape_band(shape)
    return visible_keys(band, range(shape.seqlen_q), range(shape.seqlen_k), device=device)
