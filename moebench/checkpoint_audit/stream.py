"""What every reader yields: one stream of tensors, whatever the format, and the problems it names.

A reader turns a folder into a `Checkpoint`: its format, what it was saved at (EP degree, ZeRO stage, TP),
which loads its framework supports from it, and `tensors`, one `Stored` per tensor (name, global shape,
chunks, dtype, and a lazy loader that reads that tensor alone when called). The audit never holds two
tensors' data at once, so its memory is bounded by the largest tensor, not by the checkpoint.

The problem names are the restore diagnosis's words where they mean the same thing (`not-restored`,
`permutation`, moebench.parity.restore) and the checkpoint's own where nothing was restored yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from moebench.parity import restore

NOT_RESTORED = restore.NOT_RESTORED
"""A persistent buffer the load will not restore: it comes back as its initial value (the restore diagnosis's word)."""
PERMUTATION = restore.PERMUTATION
"""An expert in another's place (the restore diagnosis's word)."""
PARAM, BUFFER, EXP_AVG, EXP_AVG_SQ, STEP = "param", "buffer", "exp_avg", "exp_avg_sq", "step"
MOMENTS = (EXP_AVG, EXP_AVG_SQ)
OPTIMIZER_ROLES = (EXP_AVG, EXP_AVG_SQ, STEP)

MISSING_EXPERT = "missing-expert"
"""A global expert absent from a layer (no tensor of its, or a stacked dimension shorter than the count)."""
DUPLICATE_EXPERT = "duplicate-expert"
"""An expert stored twice, or two experts equal value for value: one rank's copy written for another."""
EXPERT_COUNT = "expert-count"
"""The experts' tensors, the router's output size, the routing bias and the config disagree on the count."""
CHUNK_GAP = "chunk-gap"
CHUNK_OVERLAP = "chunk-overlap"
MISSING_FILE = "missing-file"
"""A file the checkpoint's index names is not there: the tensors it held are lost."""
TRUNCATED = "truncated"
"""A file shorter than its own header (or the checkpoint's metadata) says: the tensors past its end are lost."""
MISSING_STATE = "missing-state"
"""A parameter's optimizer state lacks a moment or its step."""
STATE_SHAPE = "state-shape"
"""An optimizer moment whose shape is not its parameter's."""
STEP_MISMATCH = "step-mismatch"
"""Parameters' step counts disagree."""
SHARED_STEP = "shared-step"
"""Every parameter's step is one shared object: a load that steps one steps them all."""
SHAPE = "shape"
"""Experts of one layer whose tensors of one name differ in shape or dtype."""
UNREADABLE = "unreadable"
"""A tensor the format lists and its reader could not read."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Where one stored piece sits in the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclasses.dataclass(kw_only=True)
class Stored:
    """One tensor as a reader found it: nothing of its data is read until `load()`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch's name without "torch." (float32, bfloat16, int64)."""
    chunks: tuple[Chunk, ...]
    """The pieces stored (one covering the whole tensor when it is not sharded)."""
    load: Callable[[], Any]
    """Reads this tensor (every chunk, assembled) and returns it."""
    file: str
    """The file that holds it (the first chunk's), relative to the checkpoint."""
    role: str = PARAM
    """PARAM, BUFFER or an optimizer state (EXP_AVG, EXP_AVG_SQ, STEP) of `of`."""
    of: str | None = None
    """For optimizer state: the parameter's name."""
    group: str = ""
    """The step tensor's identity where the format keeps it (a pickle's shared object): equal groups are one object."""

    @property
    def nbytes(self) -> int:
        import math

        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: str) -> int:
    import torch

    try:
        return torch.empty((), dtype=getattr(torch, dtype)).element_size()
    except (AttributeError, TypeError):
        return 1


@dataclasses.dataclass(kw_only=True)
class Problem:
    """One problem: a name (the words above), the sentence, and what it is about."""

    name: str
    sentence: str
    tensor: str = ""
    layer: str = ""
    experts: list[int] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return f"{self.name}: {self.sentence}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True)
class Checkpoint:
    """A folder as its format's reader sees it."""

    format: str
    path: str
    tensors: list[Stored]
    saved: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What it was saved at, read from the format: ep_size, zero_stage, tp_size, world_size (when it says)."""
    loads: list[str] = dataclasses.field(default_factory=list)
    """The loads its framework supports from it, in a sentence each."""
    problems: list[Problem] = dataclasses.field(default_factory=list)
    """What the reader itself found (a missing or truncated file, a load trap)."""
    config_experts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Expert counts the checkpoint's own config states ({"config.json num_local_experts": 8})."""
