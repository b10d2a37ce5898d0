"""DeepSpeed: the existing parity checks shown as rows of the library matrix (not rewritten).

- `moe.layer.MoE`, ep_size = W vs ep_size = 1, top-1 and top-2 with a residual expert: the
  `deepspeed-moe-ep` check (moebench/parity/checks_deepspeed.py);
- the engine (`deepspeed.initialize`, ZeRO 0/1/2, SGD steps), ep_size = W vs 1: the
  `deepspeed-engine-ep` check (moebench/parity/checks_engine.py).
Each row runs that check's rank function, so its comparisons, tolerances and diagnoses are the check's.
With `--resume`, the save -> load -> continue rows of moebench/libraries/ds_resume.py are added.
"""

from __future__ import annotations

from moebench.libraries.base import InstalledLibrary, Row
from moebench.parity.registry import load_all

MIN_WORLD_SIZE = 2
"""Both wrapped checks compare ep_size = W with ep_size = 1: one rank has nothing to compare."""
ROWS = (
    # (model, backend, features, the check it runs)
    ("moe.layer.MoE", "-", ("top-1", "top-2+residual"), "deepspeed-moe-ep"),
    ("engine", "zero0-2", ("loss-curve",), "deepspeed-engine-ep"),
)


class DeepSpeed(InstalledLibrary):
    name = "deepspeed"
    import_name = "deepspeed"
    extra = "deepspeed"
    dist_name = "deepspeed"
    catches = "DeepSpeed expert parallelism (its MoE layer or its engine) that differs from ep_size = 1"
    preload = ("deepspeed", "deepspeed.moe.layer")
    """Imported once in the parent before the ranks fork (as the wrapped checks do)."""

    def unavailable(self) -> str | None:
        if super().unavailable():  # a dependency of moebench itself, not an extra
            return "not installed: pip install -c moebench/constraints.txt deepspeed (a moebench dependency)"
        return None

    def rows(self, world_size: int, *, resume: bool = False) -> list[Row]:
        """The matrix at `world_size`; `resume` adds the save -> load -> continue rows (ds_resume.py)."""
        if world_size < MIN_WORLD_SIZE:
            return []
        rows = [Row(library=self.name, model=model, backend=backend, ep_mode=f"ep={world_size}",
                    world_size=world_size, features=features) for model, backend, features, _ in ROWS]
        if resume:
            from moebench.libraries.ds_resume import resume_rows

            rows += resume_rows(world_size)
        return rows

    def run_row(self, ctx, row: Row, opts) -> list:
        if "resume" in row.features:
            from moebench.libraries.ds_resume import run_resume_row

            return run_resume_row(ctx, row, opts)
        check = next(check for model, backend, _, check in ROWS if (model, backend) == (row.model, row.backend))
        return load_all()[check].rank_fn(ctx, opts)

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing a resume row (DS_API.md §4); None for the other rows."""
        if "resume" not in row.features:
            return None
        from moebench.libraries.ds_resume_repro import repro_script

        return repro_script(row, seed)


ADAPTER = DeepSpeed()
