"""torchtitan: its MoE module (token-choice top-k router, grouped experts, all-to-all token dispatch) parallelized by
torchtitan itself (0.3: `Module.parallelize(ParallelDims)`), with expert parallelism (EP), with tensor parallelism
and no EP (TP), and both (EP+TP, sequence parallel; 4 ranks), in bf16 on both sides, judged by the noise model
(bf16.py has what a row compares and how; api.py the release differences).

Backends (`parallelism.spmd_backend`), every one a row: "spmd_types" (0.3's default) exchanges tokens with a list
all_to_all of uneven sizes, which gloo refuses: its rows pad that exchange in the ranks (exchange.py, recorded in
every such row); "partial_dtensor"; "full_dtensor" (its input a DTensor of its mesh). Its undeclared import-time
dependencies (spmd_types, tyro, docstring_parser) are the extra `torchtitan`; triton (~1 GB, import-time only here)
is not installed: imports.py.

The package's files: __init__.py the adapter (rows, what cannot run here, the releases); api.py what a row builds
and the release differences; imports.py importing torchtitan without triton; bf16.py the rows' judgement.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from moebench.libraries import pins
from moebench.libraries.spec import BF16, RESUME, Adapter, Row, Settings

NAME = "torchtitan"
BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")
"""0.3's spmd backends, the default first."""
V02_BACKEND = "dtensor"
"""0.2's rows: no spmd backend to choose; its ExpertParallel shards the experts as DTensors."""
SKIPPED_BACKENDS: dict[str, str] = {}
"""torchtitan 0.3's spmd backends whose rows cannot run here, and why (none since spmd_types is bridged)."""
RELEASES = ("0.3.0 (pinned) passes but its default spmd_types backend with tp > 1 (grad-left-partial); 0.2.2 and "
            "0.2.0 pass their EP rows (torchtitan.models.moe; TP rows skip: its apply_moe_ep_tp needs torchdata and "
            "tensorboard); 0.1.0 has no MoE outside experiments/llama4")
"""What --list says about the releases, as measured here (tests/libraries/test_torchtitan_releases.py)."""
PRELOAD = ("moebench.libraries.torchtitan.imports", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch._dynamo", "torch._inductor.compile_fx")
"""The parent imports torch's pieces; torchtitan itself is imported in each rank (imports.py, ~1 s)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchtitanSettings(Settings):
    triton: str
    """The triton the row runs with: its version, or the import stand-in (imports.py)."""
    patch: str = ""
    """What the row bridges in its ranks to run on CPU ("" : nothing)."""
    dense_grads: str = "summed over the data-parallel ranks (torchtitan's FSDP, emulated)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchtitanResumeSettings(TorchtitanSettings):
    load_ep_mode: str
    """The layout the checkpoint is loaded under ("ep": the saved one; "tp": TP without EP, DCP resharding; "none": the
    module with no parallelism, 0.2)."""
    save_steps: int
    continue_steps: int
    load_balance_coeff: float
    """torchtitan's aux-loss-free load balancing: its expert bias is state the checkpoint must carry."""


def layouts(world_size: int) -> list[str]:
    """EP and TP at every world size; EP+TP (dp_shard x tp = 2, ep = W) from 4 ranks."""
    return ["ep", "tp"] + (["ep+tp"] if world_size >= 4 and world_size % 2 == 0 else [])


class Torchtitan(Adapter):
    """torchtitan's MoE under its own parallelize (see the module docstring)."""

    name = NAME
    import_name = "torchtitan"
    dist_name = "torchtitan"
    extra = "torchtitan"
    catches = ("a torchtitan EP / TP path whose output or gradients are farther from float32 than the same module "
               "on one process in bf16")
    preload = PRELOAD
    runners = {BF16: "moebench.libraries.torchtitan.bf16:run", RESUME: "moebench.libraries.torchtitan.resume:run"}
    timeout_s = 180.0

    def install_hint(self) -> str:
        return pins.no_deps_command(self.dist_name, self.extra)

    def version(self) -> str | None:
        from moebench.libraries.torchtitan import api

        return api.tt_version()

    def unavailable(self) -> str | None:
        from moebench.libraries.torchtitan import api

        if importlib.util.find_spec(self.import_name) is None or api.tt_version() is None:
            return f"not installed: {self.install_hint()}"
        missing = [m for m in ("spmd_types", "tyro", "docstring_parser") if importlib.util.find_spec(m) is None]
        if missing and api.generation() == "common":
            return f"torchtitan imports {', '.join(missing)}, which it does not declare: {self.install_hint()}"
        if api.generation() is None:
            return f"torchtitan {api.tt_version()} has no MoE module outside its experiments (models/moe: 0.2+)"
        return None

    def releases(self) -> str:
        return RELEASES

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        from moebench.libraries.torchtitan import api
        from moebench.libraries.torchtitan.imports import triton_kind

        if world_size < 2:
            return []
        triton = triton_kind()
        patch = api.V02_PATCH if api.generation() == "moe" else ""

        def row(model, backend, layout):
            from moebench.libraries.torchtitan.exchange import PATCH

            bridged = PATCH if backend == "spmd_types" and layout != "tp" else patch
            return Row(library=NAME, model=model, backend=backend, ep_mode=layout, world_size=world_size, kind=BF16,
                       settings=TorchtitanSettings(triton=triton, patch=bridged), features=("bf16",))

        if api.generation() == "moe":  # 0.2: no spmd backends; its EP step (its TP rows skip with the reason)
            return [row(model, V02_BACKEND, layout) for layout in ("ep", "tp") for model in api.MODELS] + (
                resume_rows(world_size, triton, patch) if resume else [])
        rows = [row(model, backend, layout) for backend in BACKENDS for layout in layouts(world_size)
                for model in api.MODELS]
        rows += [row(next(iter(api.MODELS)), backend, "ep") for backend in SKIPPED_BACKENDS]
        if resume:  # save -> load -> continue through torchtitan's CheckpointManager (resume.py)
            rows += resume_rows(world_size, triton)
        return rows

    def skip_reason(self, row: Row) -> str | None:
        return skip_reason(row)

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing a resume row's restore (templates/torchtitan_resume.py); None for the
        bf16 rows (their noise-model judgement needs the one-process bf16 baseline a script has not got)."""
        if row.kind != RESUME or skip_reason(row) is not None:
            return None
        from moebench.libraries.repro import fill
        from moebench.libraries.torchtitan import api
        from moebench.libraries.torchtitan.resume import LOAD_BALANCE_COEFF, LR, SAVE_STEPS

        settings = {"world": row.world_size, "seed": seed, "backend": row.backend,
                    "load_ep_mode": row.settings.load_ep_mode, "hidden": api.HIDDEN, "experts": api.NUM_EXPERTS,
                    "expert_hidden": api.EXPERT_HIDDEN, "top_k": api.TOP_K, "init_std": api.INIT_STD,
                    "gate_std": api.GATE_STD, "load_balance_coeff": LOAD_BALANCE_COEFF, "lr": LR,
                    "save_steps": SAVE_STEPS, "seqs_per_rank": api.SEQS_PER_DP_RANK, "seq_len": api.SEQ_LEN}
        return fill("torchtitan_resume", settings, key=row.key())


def resume_rows(world_size: int, triton: str, patch: str = "") -> list[Row]:
    """0.3: every backend at the same layout (EP over every rank) and loaded under TP (no EP: DCP reshards); 0.2: its
    EP step, at the same layout and loaded into the module with no parallelism ("none": DCP gathers the experts)."""
    from moebench.libraries.torchtitan import api
    from moebench.libraries.torchtitan.exchange import PATCH
    from moebench.libraries.torchtitan.resume import CONTINUE_STEPS, LOAD_BALANCE_COEFF, SAVE_STEPS

    v02 = api.generation() == "moe"
    rows = []
    for backend in ((V02_BACKEND,) if v02 else BACKENDS):
        for load in ("ep", "none" if v02 else "tp"):
            settings = TorchtitanResumeSettings(
                triton=triton, patch=PATCH if backend == "spmd_types" else patch, load_ep_mode=load,
                save_steps=SAVE_STEPS, continue_steps=CONTINUE_STEPS if load == "ep" else 0,
                load_balance_coeff=LOAD_BALANCE_COEFF)
            rows.append(Row(library=NAME, model="sigmoid-grouped+shared", backend=backend, ep_mode="ep",
                            world_size=world_size, kind=RESUME, settings=settings, features=("resume",),
                            variant="resume" if load == "ep" else f"resume-to-{load}"))
    return rows


def skip_reason(row: Row) -> str | None:
    """One line why this row cannot run here, or None."""
    from moebench.libraries.torchtitan import api

    if row.backend in SKIPPED_BACKENDS:
        return f"spmd_backend={row.backend}: {SKIPPED_BACKENDS[row.backend]}"
    if row.model not in api.MODELS or row.backend not in (*BACKENDS, V02_BACKEND) or row.ep_mode not in (
            "ep", "tp", "ep+tp"):
        return f"unknown torchtitan row {row.model}/{row.backend}/{row.ep_mode}"
    if row.world_size < 2 or api.NUM_EXPERTS % row.world_size:
        return f"{api.NUM_EXPERTS} experts do not split over {row.world_size} ranks"
    if row.ep_mode not in layouts(row.world_size):
        return f"{row.ep_mode} needs an even world size of 4 or more"
    if (api.generation() == "moe") != (row.backend == V02_BACKEND):
        return f"torchtitan {api.tt_version()} has no {row.backend} backend"
    if api.generation() == "moe" and api.load() and api.v02_lacks(row.model):
        return f"torchtitan {api.tt_version()} has no {api.v02_lacks(row.model)}"
    if row.kind == RESUME and api.generation() == "moe":
        from moebench.preload import has_module

        if not has_module("torchdata"):  # measured where the row runs: its checkpointer's import chain
            return (f"torchtitan {api.tt_version()}'s CheckpointManager imports its dataloader module, which imports "
                    "torchdata (not installed here: pip install torchdata)")
    if api.generation() == "moe" and row.ep_mode != "ep":
        return (f"torchtitan {api.tt_version()}: its TP plans live in apply_moe_ep_tp "
                "(models/llama4/infra/parallelize.py), which imports torchdata and tensorboard; only its EP step runs")
    return None


ADAPTER = Torchtitan()
