"""DeepSpeed: its MoE layer (the existing `deepspeed-moe-ep` check, shown as a row) and its engine
(ds_engine.py: one row per ZeRO stage x ep_size x feature, against a one-process reference).

- `moe.layer.MoE`, ep_size = W vs ep_size = 1, top-1 and top-2 with a residual expert: the
  `deepspeed-moe-ep` check (moebench/parity/checks_deepspeed.py), its comparisons and diagnoses;
- `engine`, ZeRO 0/1/2 x every ep_size dividing W x (plain, grad-accum, clip, bf16, and the layer
  options top-2 / drops / residual at ep_size = W): ds_engine.matrix(); with a user's config
  (`user_config`), one row per ep_size with the user's settings instead.
  With `resume` (--resume), the save -> load -> continue rows of ds_resume.py are added.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from moebench.libraries.base import InstalledLibrary, Row
from moebench.parity.registry import load_all

MIN_WORLD_SIZE = 2
"""Both wrapped checks compare ep_size = W with ep_size = 1: one rank has nothing to compare."""
ROWS = (
    # (model, backend, features, the check it runs)
    ("moe.layer.MoE", "-", ("top-1", "top-2+residual"), "deepspeed-moe-ep"),
)
"""Rows that run an existing check (the engine rows are ds_engine's: they supersede deepspeed-engine-ep)."""

IMPORT_PROBE_TIMEOUT_S = 120.0
"""Bound on the import probe (`import deepspeed` and its MoE layer in a child): a cold import of a
freshly installed release compiles its .pyc files, ~30-70 s on this 2-core machine under load."""
_IMPORT_PROBE = ("import os, torch; os.environ.setdefault('DS_ACCELERATOR', 'cuda' if torch.cuda.is_available() "
                 "else 'cpu'); import deepspeed; from deepspeed.moe.layer import MoE")
"""What a run needs from DeepSpeed before its ranks start, as the run sets it up (set_accelerator_env)."""


PRELOAD = (
    "deepspeed", "deepspeed.moe.layer",
    "torch._dynamo",  # torch's optimizers import it when built (torch.optim.optimizer's _disable_dynamo)
    "torch._inductor.compile_fx",  # 0.19's Muon module calls torch.compile at import, which imports inductor
    "deepspeed.runtime.zero.muon.muon_optimizer",  # imported by the engine's optimizer check (0.19)
    "deepspeed.module_inject.auto_ep_layer",  # AutoEP, imported by deepspeed.initialize (0.19)
    "deepspeed.checkpoint.ds_to_universal",  # the universal resume rows' converter
    "deepspeed.ops.op_builder.all_ops",  # init_distributed's op probe (imports setuptools)
    "deepspeed.comm.mori",  # init_distributed (0.19)
    "moebench.variants.deepspeed.comm", "moebench.libraries.ds_engine", "moebench.libraries.ds_mechanisms",
    "moebench.libraries.ds_resume",
)
"""Modules a row's ranks would otherwise each import lazily, at every row: ~1,500 modules, 4.1 of a
4.4 s engine row at W = 4 (measured on 0.19.8). Forked ranks inherit them from the parent."""


def source_version(package_dir: Path) -> str | None:
    """The version a DeepSpeed source tree says it is, without importing it: the `version='...'` line
    its build writes into git_version_info_installed.py, else its version.txt."""
    for name, pattern in (("git_version_info_installed.py", r"^version\s*=\s*['\"]([^'\"]+)['\"]"),
                          ("../version.txt", r"^\s*(\S+)")):
        try:
            text = (package_dir / name).read_text(encoding="utf-8", errors="replace")[:4096]
        except OSError:
            continue
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            return match.group(1)
    return None


@functools.lru_cache(maxsize=8)
def _import_problem(origin: str) -> str | None:
    """One line why `import deepspeed` (found at `origin`) fails here; None when it imports. Runs in
    a child: a failing import must not leave half a DeepSpeed in this process."""
    try:
        done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True,
                              timeout=IMPORT_PROBE_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return f"importing it took more than {IMPORT_PROBE_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)),
                lines[-1] if lines else f"exit code {done.returncode}")
    return f"does not import here: {re.sub(r' ?[(]/[^)]*[)]', '', last)}"  # without the "(/path/file.py)"


class DeepSpeed(InstalledLibrary):
    name = "deepspeed"
    import_name = "deepspeed"
    extra = "deepspeed"
    dist_name = "deepspeed"
    catches = "DeepSpeed expert parallelism (its MoE layer or its engine) that differs from ep_size = 1"

    preload = PRELOAD
    """Imported once in the parent before each row's ranks fork (of it, what this release has: moebench.preload)."""

    def version(self) -> str | None:
        """The version of the DeepSpeed that `import deepspeed` loads: the distribution's metadata when
        it describes that copy (a `pip install --target` copy first on PYTHONPATH carries its own), else
        the version its source tree records (a checkout on PYTHONPATH has no metadata of its own)."""
        spec = importlib.util.find_spec(self.import_name)
        if spec is None or not spec.origin:
            return None
        origin = Path(spec.origin).resolve()
        try:
            dist = importlib.metadata.distribution(self.dist_name)
            if Path(dist.locate_file(f"{self.import_name}/__init__.py")).resolve() == origin:
                return dist.version
        except importlib.metadata.PackageNotFoundError:
            pass
        return source_version(origin.parent)

    def unavailable(self) -> str | None:
        if super().unavailable():  # a dependency of moebench itself, not an extra
            return "not installed: pip install -c moebench/constraints.txt deepspeed (a moebench dependency)"
        return _import_problem(importlib.util.find_spec(self.import_name).origin)

    def rows(self, world_size: int, user_config: dict[str, Any] | None = None, *,
             resume: bool = False) -> list[Row]:
        """The matrix at `world_size`; with `user_config` (zero_stage / clip / grad_accum / precision from
        a user's DeepSpeed config) one engine row per ep_size dividing W with those settings instead."""
        from moebench.libraries import ds_engine

        if world_size < MIN_WORLD_SIZE:
            return []
        if user_config is not None:
            rows = [ds_engine.row_of(s, world_size, variant="ds-config")
                    for s in ds_engine.user_rows_settings(world_size, user_config)]
        else:
            rows = [Row(library=self.name, model=model, backend=backend, ep_mode=f"ep={world_size}",
                        world_size=world_size, features=features) for model, backend, features, _ in ROWS]
            rows += [ds_engine.row_of(s, world_size) for s in ds_engine.matrix(world_size)]
        if resume:
            from moebench.libraries.ds_resume import resume_rows

            rows += resume_rows(world_size)
        return rows

    def run_row(self, ctx, row: Row, opts) -> list:
        if "resume" in row.features:
            from moebench.libraries.ds_resume import run_resume_row

            return run_resume_row(ctx, row, opts)
        if row.model == "engine":
            from moebench.libraries import ds_engine

            return ds_engine.run(ctx, row, opts)
        check = next(check for model, backend, _, check in ROWS if (model, backend) == (row.model, row.backend))
        return load_all()[check].rank_fn(ctx, opts)

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing an engine or a resume row (repro.py); None for the others."""
        if "resume" in row.features:
            from moebench.libraries.ds_resume_repro import repro_script

            return repro_script(row, seed)
        from moebench.libraries.repro import deepspeed_engine_script

        return deepspeed_engine_script(row, seed)


ADAPTER = DeepSpeed()
