"""DeepSpeed: its MoE layer (the existing `deepspeed-moe-ep` check, shown as a row) and its engine
(ds_engine.py: one row per ZeRO stage x ep_size x feature, against a one-process reference).

- `moe.layer.MoE`, ep_size = W vs ep_size = 1, top-1 and top-2 with a residual expert: the
  `deepspeed-moe-ep` check (moebench/parity/checks_deepspeed.py), its comparisons and diagnoses;
- `engine`, ZeRO 0/1/2 x every ep_size dividing W x (plain, grad-accum, clip, bf16, and the layer
  options top-2 / drops / residual at ep_size = W): ds_engine.matrix(); with a user's config
  (`user_config`), one row per ep_size with the user's settings instead.
"""

from __future__ import annotations

from moebench.libraries.base import InstalledLibrary, Row
from moebench.parity.registry import load_all

MIN_WORLD_SIZE = 2
"""Both wrapped checks compare ep_size = W with ep_size = 1: one rank has nothing to compare."""
ROWS = (
    # (model, backend, features, the check it runs)
    ("moe.layer.MoE", "-", ("top-1", "top-2+residual"), "deepspeed-moe-ep"),
)
"""Rows that run an existing check (the engine rows are ds_engine's: they supersede deepspeed-engine-ep)."""


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

    def rows(self, world_size: int, user_config: dict | None = None) -> list[Row]:
        """The matrix at `world_size`; with `user_config` (zero_stage / clip / grad_accum / precision from
        a user's DeepSpeed config) one engine row per ep_size dividing W with those settings instead."""
        from moebench.libraries import ds_engine

        if world_size < MIN_WORLD_SIZE:
            return []
        if user_config is not None:
            return [ds_engine.row_of(s, world_size, variant="ds-config")
                    for s in ds_engine.user_rows_settings(world_size, user_config)]
        layer = [Row(library=self.name, model=model, backend=backend, ep_mode=f"ep={world_size}",
                     world_size=world_size, features=features) for model, backend, features, _ in ROWS]
        return layer + [ds_engine.row_of(s, world_size) for s in ds_engine.matrix(world_size)]

    def run_row(self, ctx, row: Row, opts) -> list:
        if row.model == "engine":
            from moebench.libraries import ds_engine

            return ds_engine.run(ctx, row, opts)
        check = next(check for model, backend, _, check in ROWS if (model, backend) == (row.model, row.backend))
        return load_all()[check].rank_fn(ctx, opts)


ADAPTER = DeepSpeed()
