"""What the layer harness's modules share: the forward's output, the loss, and the sync choices."""

from __future__ import annotations

from typing import Any

import torch

from moebench.parity.raised import AdapterProtocolError

SYNC_STANDARD = "standard"
"""The default gradient sync: every non-expert gradient all-reduced and averaged over the ranks, every expert
gradient divided by the world size (it already holds every rank's tokens' share, brought by the backward
exchange, and the global loss is the mean of the ranks' losses)."""
SYNC_NONE = "none"
"""The layer's backward leaves every gradient final (it syncs itself)."""


def output_of(result: Any) -> torch.Tensor:
    """The layer's output: its return value, or the first element of a tuple (an aux loss beside it is the layer's)."""
    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise AdapterProtocolError(f"the layer's forward returned a {type(result).__name__}; it must return the "
                                   "output tensor (or a tuple whose first element is)")
    return result


def loss_of(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A rank's loss: the mean over its tokens of <y, target> (linear in y: see run.py)."""
    return (y * t).sum(-1).mean()
