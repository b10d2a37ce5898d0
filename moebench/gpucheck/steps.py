"""The steps of `moebench gpu-check`, as data: name, what it checks, the command it runs, its budget.

Each step is one or more child commands (`python -m moebench ...` or a module of this package),
run with a hard deadline of `budget_s` (moebench.gpucheck.runner). A step whose `needs` did not
pass is skipped with the reason; a step of `min_gpus` > the machine's GPUs is skipped too.
`derived` steps run no command: they judge what earlier steps recorded.

The budgets of the one-GPU steps, plus `OVERHEAD_S` for the preflight, the install and the
report around them, add up to at most `TOTAL_BUDGET_S` (8 minutes on one data-centre GPU; a test
holds the table to it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

TOTAL_BUDGET_S = 480.0
"""The issue's bound for `make gpu-check` on one current data-centre GPU, install and report included."""
OVERHEAD_S = 40.0
"""Outside the steps: the preflight (a torch import, ~3 s), the offline install (~10 s when the
venv exists, ~20 s to create it) and `moebench report` after (~5 s)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
    """What a step's command line is built from."""

    python: str
    """The interpreter of every child (the one running gpu-check)."""
    results_root: Path
    run_path: Path
    """This gpu-check's own folder (results/gpu-check/<id>/)."""
    gpu_count: int
    fastmoe_src: str | None
    fastmoe_build: Path
    """Where the fastmoe build goes (reused when its stamp matches)."""

    def moebench(self, *args: str) -> list[str]:
        return [self.python, "-m", "moebench", *args, "--json", "--results-dir", str(self.results_root)]

    def module(self, name: str, *args: str) -> list[str]:
        return [self.python, "-m", f"moebench.gpucheck.{name}", *args]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    name: str
    """Stable id (--skip takes these; gpucheck.json keys on it)."""
    title: str
    """What it checks, one line."""
    budget_s: float
    """Deadline of each of its commands: a command still running then is killed (status timeout)."""
    commands: Callable[[Context], list[list[str]]] | None = None
    """The child command lines (None for a derived step)."""
    needs: tuple[str, ...] = ()
    """Steps that must have passed first."""
    min_gpus: int = 1
    """Skipped (with the reason) on a machine with fewer GPUs."""

    @property
    def derived(self) -> bool:
        return self.commands is None


BUILD_BUDGET_S = 150.0
"""fastmoe's build (about a minute for one arch, estimated) with room for one retry without NCCL."""


def _build(ctx: Context) -> list[list[str]]:
    args = ["--out", str(ctx.fastmoe_build), "--deadline-s", str(BUILD_BUDGET_S - 10.0)]
    if ctx.fastmoe_src:
        args += ["--src", ctx.fastmoe_src]
    return [ctx.module("build", *args)]


def _run_fastmoe(impl: str) -> Callable[[Context], list[list[str]]]:
    return lambda ctx: [ctx.moebench("run", "fastmoe", "--preset", "chapter", "--moe-impl", impl, "--device", "cuda")]


def _verify_parity(ctx: Context) -> list[list[str]]:
    return [ctx.moebench("verify-parity", "--comm-backend", "nccl", "--world-size", str(w))
            for w in range(2, ctx.gpu_count + 1)]


STEPS: tuple[Step, ...] = (
    Step(name="fastmoe-build", budget_s=BUILD_BUDGET_S, commands=_build,
         title="the chapter's pitfalls (nvcc vs torch CUDA, NCCL >= 2.7.5 and nccl.h for USE_NCCL, dm-tree), "
               "then fastmoe built from FASTMOE_SRC (one retry with USE_NCCL=0 on a one-GPU machine)"),
    Step(name="env-check", budget_s=40.0,
         commands=lambda ctx: [ctx.moebench("env-check", "--strict")],
         title="env-check --strict on the real toolchain: driver, nvcc vs torch.version.cuda, NCCL, "
               "DeepSpeed's ops, the fastmoe just built"),
    Step(name="layers", budget_s=40.0, needs=("fastmoe-build",),
         commands=lambda ctx: [ctx.module("layers")],
         title="real fmoe layer vs moebench's reference, same seed, gates naive / gshard / switch / noisy: "
               "weights, outputs, input gradient, every parameter's gradient, aux loss"),
    Step(name="run-fmoe", budget_s=50.0, needs=("fastmoe-build",), commands=_run_fastmoe("fmoe"),
         title="run fastmoe --preset chapter --moe-impl fmoe --device cuda"),
    Step(name="run-reference", budget_s=50.0, commands=_run_fastmoe("reference"),
         title="run fastmoe --preset chapter --moe-impl reference --device cuda"),
    Step(name="runs-compare", budget_s=0.0, needs=("run-fmoe", "run-reference"),
         title="the two chapter runs: equal parameter counts, loss curves within the fixed tolerance, "
               "tokens/s of each"),
    Step(name="run-deepspeed", budget_s=60.0,
         commands=lambda ctx: [ctx.moebench("run", "deepspeed", "--preset", "chapter", "--device", "cuda")],
         title="run deepspeed --preset chapter --device cuda"),
    Step(name="bench", budget_s=50.0, commands=lambda ctx: [ctx.module("gpubench")],
         title="one MoE layer on the GPU: reference, grouped GEMM, DeepSpeed cf 1 / 2, fmoe vs the per-expert "
               "ideal and dense GEMM; TFLOP/s and share of the device's fp32 / bf16 peak"),
    Step(name="nccl-probe", budget_s=0.0, min_gpus=2,
         title="env-check's NCCL probe on 2 ranks (all_reduce, variable all_gather, uneven all_to_all)"),
    Step(name="verify-parity-nccl", budget_s=120.0, min_gpus=2, commands=_verify_parity,
         title="verify-parity --comm-backend nccl at every world size from 2 to the GPU count"),
)
"""In order. The multi-GPU steps come last and are outside the one-GPU budget."""

NAMES = tuple(s.name for s in STEPS)


def by_name(name: str) -> Step:
    return next(s for s in STEPS if s.name == name)


def one_gpu_budget_s() -> float:
    """What the steps that run on one GPU may take, all deadlines reached."""
    return sum(s.budget_s for s in STEPS if s.min_gpus <= 1) + OVERHEAD_S


def describe() -> list[tuple[str, str, str, str]]:
    """(name, budget, needs, title) rows for `--list` and the docs."""
    return [(s.name, "derived" if s.derived else f"{s.budget_s:.0f} s" + (" each" if s.name.endswith("nccl") else ""),
             ", ".join(s.needs) + (f"{', ' if s.needs else ''}{s.min_gpus}+ GPUs" if s.min_gpus > 1 else ""),
             s.title) for s in STEPS]
