"""DeepSpeed: its MoE layer (the existing `deepspeed-moe-ep` check, shown as a row) and its engine, against one
process. The package's files, each one role (docs/adding-a-library.md):

- __init__.py: the adapter (identity, rows, runners, release handling: which copy imports, its version);
- engine.py: the engine rows (ZeRO 0/1/2 x every ep_size dividing W x one feature at a time: grad-accum, clip,
  bf16, and the layer options top-2 / drops / residual at ep_size = W) and their one-process reference;
- mechanisms.py: the mechanism behind an engine row's first divergence;
- resume.py: the save -> load -> continue rows (--resume);
- user_config.py: a user's DeepSpeed config (--ds-config) as the engine rows' settings;
- repro.py: the settings of an engine or resume row's standalone reproduction script (libraries/repro).
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

from moebench.libraries.deepspeed.releases import COMPATIBILITY
from moebench.libraries.spec import RESUME, Adapter, Row

MIN_WORLD_SIZE = 2
"""Every row compares ep_size = W (or some ep_size > 1) with ep_size = 1: one rank has nothing to compare."""
LAYER = "layer"
"""Row kind of the layer row: `moe.layer.MoE` at ep_size = W vs ep_size = 1, top-1 and top-2 with a residual
expert, which is the `deepspeed-moe-ep` check (moebench/parity/checks_deepspeed.py) shown as a row."""
LAYER_CHECK = "deepspeed-moe-ep"
ENGINE = "engine"
"""Row kind of the engine rows (engine.py; they supersede the deepspeed-engine-ep check)."""

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
    "moebench.variants.deepspeed.comm", "moebench.libraries.deepspeed.engine",
    "moebench.libraries.deepspeed.mechanisms", "moebench.libraries.deepspeed.resume",
)
"""Modules a row's ranks would otherwise each import lazily, at every row: ~1,500 modules, 4.1 of a
4.4 s engine row at W = 4 (measured on 0.19.8). Forked ranks inherit them from the parent. Of these, only
what the installed release has is imported (moebench.preload): 0.14 has no Muon, no AutoEP, no mori."""


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
    a child: a failing import must not leave half a DeepSpeed in this process; remembered per installation
    (moebench.probecache: the child takes ~2.5 s, the rest of `--list` less)."""
    from importlib.metadata import PackageNotFoundError, version

    from moebench import probecache

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "?"
    key = probecache.fingerprint(origin, _IMPORT_PROBE, torch_version, os.environ.get("DS_ACCELERATOR", ""))
    return probecache.answer(key, lambda: _probe_import(origin))


def _probe_import(origin: str) -> str | None:
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


def _run_layer(ctx, row: Row, opts) -> list:
    from moebench.parity.registry import load_all

    return load_all()[LAYER_CHECK].rank_fn(ctx, opts)


class DeepSpeed(Adapter):
    name = "deepspeed"
    compatibility = COMPATIBILITY
    import_name = "deepspeed"
    extra = "deepspeed"
    dist_name = "deepspeed"
    catches = "DeepSpeed expert parallelism (its MoE layer or its engine) that differs from ep_size = 1"
    preload = PRELOAD
    runners = {LAYER: _run_layer, ENGINE: "moebench.libraries.deepspeed.engine:run",
               RESUME: "moebench.libraries.deepspeed.resume:run"}

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
        if importlib.util.find_spec(self.import_name) is None:  # a dependency of moebench itself, not an extra
            return "not installed: pip install -c moebench/constraints.txt deepspeed (a moebench dependency)"
        return _import_problem(importlib.util.find_spec(self.import_name).origin)

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        """The matrix at `world_size`; with `user_config` (zero_stage / clip / grad_accum / precision from
        a user's DeepSpeed config) one engine row per ep_size dividing W with those settings instead."""
        from moebench.libraries.deepspeed import engine

        if world_size < MIN_WORLD_SIZE:
            return []
        if user_config is not None:
            rows = [engine.row_of(s, world_size, variant="ds-config")
                    for s in engine.user_rows_settings(world_size, dict(user_config))]
        else:
            rows = [Row(library=self.name, model="moe.layer.MoE", backend="-", ep_mode=f"ep={world_size}",
                        world_size=world_size, kind=LAYER, features=("top-1", "top-2+residual"))]
            rows += [engine.row_of(s, world_size) for s in engine.matrix(world_size)]
        if resume:
            from moebench.libraries.deepspeed.resume import resume_rows

            rows += resume_rows(world_size)
        return rows

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing an engine or a resume row (repro.py); None for the layer row."""
        from moebench.libraries.deepspeed import repro

        return repro.script(row, seed)


ADAPTER = DeepSpeed()
