"""The bounds of `moebench checkpoint`'s inputs, declared once for the CLI and the Python API (torch-free)."""

from __future__ import annotations

from moebench import bounds

PATH_BOUND = bounds.Path(folder=True)
"""PATH and --against: a checkpoint folder (a path that does not exist is refused by the audit, naming the argument,
so an example in --help parses anywhere)."""
FILE_BOUND = bounds.Path(folder=False, must_exist=True)
"""--hf-config: an existing file (read as a model's config.json, at most 1 MiB)."""
EXPERTS_MAX = 1 << 20
EXPERTS_BOUND = bounds.Number(integer=True, min=1, max=EXPERTS_MAX)
"""--experts: experts per MoE layer, over all ranks (at most a million: the largest MoE models have hundreds)."""
BOUNDS = {"path": PATH_BOUND, "against": PATH_BOUND, "hf_config": FILE_BOUND, "experts": EXPERTS_BOUND}
FLAGS = {"path": "PATH", "against": "--against", "hf_config": "--hf-config", "experts": "--experts"}
