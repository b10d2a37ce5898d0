"""torchtitan: its MoE module (token-choice top-k router, grouped experts, all-to-all token dispatch) parallelized by
torchtitan itself (0.3: its trainer's path, the model's parallelize function: `Module.parallelize(ParallelDims)`
and fully_shard), with expert parallelism (EP), with tensor parallelism and no EP (TP), and both (EP+TP, sequence
parallel; 4 ranks), in bf16 on both sides, judged by the noise model (bf16.py has what a row compares and how;
api.py the release differences).

Backends (`parallelism.spmd_backend`), every one a row: "spmd_types" (0.3's default) exchanges tokens with a list
all_to_all of uneven sizes, which gloo refuses: its rows pad that exchange in the ranks (exchange.py, recorded in
every such row); "partial_dtensor"; "full_dtensor" (its input a DTensor of its mesh). Its undeclared import-time
dependencies (spmd_types, tyro, docstring_parser) are the extra `torchtitan`; triton (~1 GB, import-time only here)
is not installed: imports.py.

The package's files: __init__.py the adapter (rows, what cannot run here, the releases); api.py what a row builds
and the release differences; trainer.py 0.3's trainer path (its parallelize function, fully_shard); shell.py the
model shape around one MoE; imports.py importing torchtitan without triton; bf16.py the rows' judgement; resume.py
the resume rows;
user_setup.py --torchtitan-args (a user's launch read by torchtitan's ConfigManager) and train.py its training-steps
row (accumulation, torchtitan's clip, optimizers container and load-balancing hook).
"""

from __future__ import annotations

import dataclasses
import importlib.util

from moebench.libraries import pins
from moebench.libraries.spec import BF16, RESUME, Adapter, Emulated, Row, Settings
from moebench.libraries.torchtitan.releases import COMPATIBILITY
from moebench.parity.diagnosis import EXPERTS, REDUCTION_MECHANISMS, REPLICATED, ROUTER

NAME = "torchtitan"
BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")
"""0.3's spmd backends, the default first."""
ONE_MESH_BACKENDS = ("spmd_types", "full_dtensor")
"""The backends whose trainer path (FSDP over the full SPMD mesh) takes one ParallelDims per process: measured, the
EP W/2 -> EP W resume rows' second build raises in fully_shard (partial_dtensor's meshes are its own)."""
EMULATED_GRADS = "summed over the data-parallel ranks (torchtitan's FSDP, emulated)"
GLOO_SUM = ("FSDP's reduce-scatter as SUM (set_force_sum_reduction_for_comms: gloo has no PREMUL_SUM, which FSDP "
            "picks for torchtitan's divide factor 1; the same numbers)")
V02_BACKEND = "dtensor"
"""0.2's rows: no spmd backend to choose; its ExpertParallel shards the experts as DTensors."""
SKIPPED_BACKENDS: dict[str, str] = {}
"""torchtitan 0.3's spmd backends whose rows cannot run here, and why (none since spmd_types is bridged)."""
PRELOAD = ("moebench.libraries.torchtitan.imports", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch._dynamo", "torch._inductor.compile_fx")
"""The parent imports torch's pieces; torchtitan itself is imported in each rank (imports.py, ~1 s)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchtitanSettings(Settings):
    triton: str
    """The triton the row runs with: its version, or the import stand-in (imports.py)."""
    patch: str = ""
    """What the row bridges in its ranks to run on CPU ("" : nothing)."""
    dense_grads: str = EMULATED_GRADS
    """Who reduces the gradients over the data-parallel ranks: torchtitan's FSDP through its trainer's parallelize
    function (0.3), or moebench, emulating it (0.2; a train row's steps): then recorded as an emulated piece."""
    gloo: str = ""
    """How FSDP's reduction runs on gloo where it is applied (api.GLOO_SUM)."""

    def emulated(self) -> tuple[Emulated, ...]:
        if self.dense_grads != EMULATED_GRADS:
            return ()
        return (Emulated(piece="torchtitan's FSDP gradient reduction", groups=(ROUTER, EXPERTS, REPLICATED),
                         mechanisms=REDUCTION_MECHANISMS),)


def trainer_grads(fn_path: str, param_dtype: str = "") -> str:
    """A 0.3 row's `dense_grads`: torchtitan's FSDP as its trainer applies it, through the model's parallelize (with
    the training.mixed_precision_param it is given, where not the default bfloat16)."""
    dtype = f", mixed_precision_param {param_dtype}" if param_dtype else ""
    return (f"reduced by torchtitan's FSDP: fully_shard through {fn_path.rpartition(':')[2]}, as its trainer "
            f"applies it{dtype}")


TRAIN = "train"
"""Row kind: a user row's training steps (accumulation, torchtitan's clip, its optimizers container and load
balancing hook), train.py."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchtitanUserSettings(TorchtitanSettings):
    """A row of the user's own launch (--torchtitan-args): what it runs with, each field read from the parsed
    Trainer.Config (user_setup.py) and fitted to the world size (user_rows)."""

    config: str
    """torchtitan's --module and --config."""
    experts: int
    experts_user: int
    top_k: int
    score_func: str
    route_norm: bool
    route_scale: float
    groups: int | None
    limited_groups: int | None
    shared_mult: int
    """The shared expert's hidden width in routed-expert widths (0: no shared expert)."""
    load_balance_coeff: float | None
    dp: int
    """data_parallel_shard_degree of the row (the ranks left over)."""
    tp: int
    ep: int
    sp: bool
    """Sequence parallel: each TP rank its slice of the positions (torchtitan's EP+TP)."""
    ep_user: int
    tp_user: int
    max_norm: float
    accum: int
    dtype: str
    """training.dtype: "float32" (float32 masters) or "bfloat16" (everything in bf16)."""
    mp_param: str
    """training.mixed_precision_param: the compute dtype with float32 masters."""
    optimizer: str
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    steps: int = 0
    """Optimizer steps of a train row (0: the bf16 row, one forward and backward)."""
    parallelize_fn: str = ""
    """The "module:function" the user's model spec hands torchtitan's trainer (its FSDP applied through it)."""
    reshard_after_forward: str = "default"
    """parallelism.fsdp_reshard_after_forward, as the launch sets it (its FSDP's)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchtitanResumeSettings(TorchtitanSettings):
    load_ep_mode: str
    """The layout the checkpoint is loaded under ("ep": the saved one; "tp": TP without EP, DCP resharding; "none": the
    module with no parallelism, 0.2)."""
    save_steps: int
    continue_steps: int
    load_balance_coeff: float
    """torchtitan's aux-loss-free load balancing: its expert bias is state the checkpoint must carry."""
    save_ep: int = 0
    """The EP degree the checkpoint is saved under (0: every rank); below the world size the experts keep an
    expert-data-parallel axis (efsdp = W / save_ep), and the load under EP over every rank reshards through DCP."""


def layouts(world_size: int) -> list[str]:
    """EP and TP at every world size; EP+TP (dp_shard x tp = 2, ep = W) from 4 ranks."""
    return ["ep", "tp"] + (["ep+tp"] if world_size >= 4 and world_size % 2 == 0 else [])


class Torchtitan(Adapter):
    """torchtitan's MoE under its own parallelize (see the module docstring)."""

    name = NAME
    compatibility = COMPATIBILITY
    import_name = "torchtitan"
    dist_name = "torchtitan"
    extra = "torchtitan"
    catches = ("a torchtitan EP / TP path whose output or gradients are farther from float32 than the same module "
               "on one process in bf16")
    preload = PRELOAD
    runners = {BF16: "moebench.libraries.torchtitan.bf16:run", RESUME: "moebench.libraries.torchtitan.resume:run",
               TRAIN: "moebench.libraries.torchtitan.train:run"}
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


    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        from moebench.libraries.torchtitan import api, trainer
        from moebench.libraries.torchtitan.imports import triton_kind

        if world_size < 2:
            return []
        if user_config is not None:  # --torchtitan-args: the user's launch, fitted to the world size
            return user_rows(world_size, user_config)
        triton = triton_kind()
        patch = api.V02_PATCH if api.generation() == "moe" else ""

        def row(model, backend, layout):
            from moebench.libraries.torchtitan.exchange import PATCH

            bridged = PATCH if backend == "spmd_types" and layout != "tp" else patch
            fsdp = {} if api.generation() == "moe" else {
                "dense_grads": trainer_grads(trainer.PARALLELIZE_FN[model]), "gloo": GLOO_SUM}
            return Row(library=NAME, model=model, backend=backend, ep_mode=layout, world_size=world_size, kind=BF16,
                       settings=TorchtitanSettings(triton=triton, patch=bridged, **fsdp), features=("bf16",))

        if api.generation() == "moe":  # 0.2: no spmd backends; its EP step, and apply_moe_ep_tp's TP where it imports
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

    def note(self) -> str | None:
        """Where this torch's fully_shard cannot take spmd_types' parameters: those rows refuse (fsdp_refusal)."""
        from moebench.libraries.torchtitan import api, trainer

        if api.generation() != "common" or trainer.fsdp_refusal("spmd_types") is None:
            return None
        return (f"its spmd_types rows (its default backend) are refused on torch {trainer._torch_version()}: its "
                f"trainer's fully_shard takes them from torch {trainer.SPMD_FSDP_TORCH} on")

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing a resume row's restore (templates/torchtitan_resume.py); None for the
        bf16 rows (their noise-model judgement needs the one-process bf16 baseline a script has not got) and the
        EP W/2 -> W rows."""
        if row.kind != RESUME or skip_reason(row) is not None or row.settings.save_ep:
            return None  # (the script saves and loads in one layout: not the EP W/2 -> W rows)
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
    """0.3: every backend at the same layout (EP over every rank), loaded under TP (no EP: DCP reshards) and, from 4
    ranks, saved under EP W/2 and loaded under EP W; 0.2: its EP step, at the same layout and loaded into the module
    with no parallelism ("none": DCP gathers the experts)."""
    from moebench.libraries.torchtitan import api, trainer
    from moebench.libraries.torchtitan.exchange import PATCH
    from moebench.libraries.torchtitan.resume import CONTINUE_STEPS, LOAD_BALANCE_COEFF, SAVE_STEPS

    v02 = api.generation() == "moe"
    from moebench.libraries.torchtitan.resume import FSDP_PARAM_DTYPE

    fsdp = {} if v02 else {"dense_grads": trainer_grads(trainer.PARALLELIZE_FN["sigmoid-grouped+shared"],
                                                        FSDP_PARAM_DTYPE), "gloo": GLOO_SUM}
    rows = []
    for backend in ((V02_BACKEND,) if v02 else BACKENDS):
        for load in ("ep", "none" if v02 else "tp"):
            settings = TorchtitanResumeSettings(
                triton=triton, patch=PATCH if backend == "spmd_types" else patch, load_ep_mode=load,
                save_steps=SAVE_STEPS, continue_steps=CONTINUE_STEPS if load == "ep" else 0,
                load_balance_coeff=LOAD_BALANCE_COEFF, **fsdp)
            rows.append(Row(library=NAME, model="sigmoid-grouped+shared", backend=backend, ep_mode="ep",
                            world_size=world_size, kind=RESUME, settings=settings, features=("resume",),
                            variant="resume" if load == "ep" else f"resume-to-{load}"))
        if not v02 and world_size >= 4 and world_size % 2 == 0:  # EP W/2 (efsdp 2) -> EP W: DCP reshards
            half = world_size // 2
            settings = TorchtitanResumeSettings(
                triton=triton, patch=PATCH if backend == "spmd_types" else patch, load_ep_mode="ep",
                save_steps=SAVE_STEPS, continue_steps=0, load_balance_coeff=LOAD_BALANCE_COEFF, save_ep=half,
                **fsdp)
            rows.append(Row(library=NAME, model="sigmoid-grouped+shared", backend=backend, ep_mode="ep",
                            world_size=world_size, kind=RESUME, settings=settings, features=("resume",),
                            variant=f"resume-ep{half}-to-ep{world_size}"))
    return rows


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def user_layout(user: dict, world_size: int) -> tuple[int, int, int, bool]:
    """(dp_shard, tp, ep, sequence parallel) of the user's launch at `world_size`: each degree the user's where it
    fits,
    else the largest that does (TP dividing W; EP dividing W and the experts, a multiple of TP as torchtitan's mesh
    borrows it from dp_shard x tp); the data-parallel degree the ranks left over."""
    tp = max(d for d in divisors(world_size) if d <= user["tp"])
    ep = max(d for d in divisors(world_size)
             if d <= user["ep"] and user["experts"] % d == 0 and (d == 1 or d % tp == 0))
    return world_size // tp, tp, ep, tp > 1 and ep > 1


def user_rows(world_size: int, user: dict) -> list[Row]:
    """The user's rows at `world_size`: the bf16 forward / backward row (bf16.py) and the training-steps row
    (train.py), both at the user's MoE, layout and backend."""
    from moebench.libraries.torchtitan.exchange import PATCH
    from moebench.libraries.torchtitan.imports import triton_kind
    from moebench.libraries.torchtitan.train import STEPS
    from moebench.libraries.torchtitan.user_setup import MAX_ROW_ACCUM

    dp, tp, ep, sp = user_layout(user, world_size)
    accum = user["accum"]
    if accum is None:  # data_parallel_shard_degree -1: the accumulation at this row's data-parallel degree
        per_step = user["local_batch"] * dp * user["dp_replicate"]
        accum = user["global_batch"] // per_step if user["global_batch"] % per_step == 0 else 1
    accum = max(1, min(accum, MAX_ROW_ACCUM))
    fields = {k: user[k] for k in ("experts", "experts_user", "top_k", "score_func", "route_norm", "route_scale",
                                   "groups", "limited_groups", "shared_mult", "load_balance_coeff", "max_norm",
                                   "dtype", "mp_param", "optimizer", "lr", "beta1", "beta2", "eps", "weight_decay")}
    settings = TorchtitanUserSettings(
        triton=triton_kind(), patch=PATCH if user["backend"] == "spmd_types" and ep > 1 else "",
        config=f"{user['module']}:{user['config']}", dp=dp, tp=tp, ep=ep, sp=sp, ep_user=user["ep"],
        tp_user=user["tp"], accum=accum, parallelize_fn=user.get("parallelize_fn", ""),
        reshard_after_forward=user.get("reshard_after_forward", "default"),
        dense_grads=trainer_grads(user["parallelize_fn"]) if user.get("parallelize_fn") else EMULATED_GRADS,
        gloo=GLOO_SUM if user.get("parallelize_fn") else "", **fields)
    layout = ",".join([f"ep={ep}"] * (ep > 1) + [f"tp={tp}"] * (tp > 1)) or f"dp={dp}"
    said = [f"{what} {mine} verified at {ours}, the largest that fits {world_size} ranks"
            for what, mine, ours in (("EP", user["ep"], ep), ("TP", user["tp"], tp)) if mine > ours]
    note = "; ".join(said)
    model = user["config"][:64]
    common = dict(library=NAME, model=model, backend=user["backend"], ep_mode=layout, world_size=world_size)
    return [Row(**common, kind=BF16, settings=settings, features=("bf16", "user"), note=note),
            Row(**common, kind=TRAIN, settings=dataclasses.replace(settings, steps=STEPS, dense_grads=EMULATED_GRADS,
                                                                   gloo=""),
                features=("bf16", "user", "clip", *(("grad-accum",) if accum > 1 else ())), variant="train",
                note=note)]


def user_skip(row: Row) -> str | None:
    from moebench.libraries.torchtitan import api

    s = row.settings
    if api.generation() != "common":
        return f"torchtitan {api.tt_version()} has no ConfigManager to read --torchtitan-args (0.3+)"
    if s.experts % s.ep or row.world_size != s.dp * s.tp:
        return f"{s.experts} experts / EP {s.ep} / TP {s.tp} do not fit {row.world_size} ranks"
    return None


def skip_reason(row: Row) -> str | None:
    """One line why this row cannot run here, or None."""
    from moebench.libraries.torchtitan import api

    if isinstance(row.settings, TorchtitanUserSettings):
        return user_skip(row)
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
    if row.kind == RESUME and getattr(row.settings, "save_ep", 0) and row.backend in ONE_MESH_BACKENDS:
        return (f"spmd_backend={row.backend}: a save under EP {row.settings.save_ep} and a load under EP "
                f"{row.world_size} take two ParallelDims in one process, and FSDP on the full SPMD mesh refuses the "
                "second's parameters (\"different mesh objects\"); a resumed run is a new process")
    if row.kind == RESUME and api.generation() == "moe":
        from moebench.preload import has_module

        if not has_module("torchdata"):  # measured where the row runs: its checkpointer's import chain
            return (f"torchtitan {api.tt_version()}'s CheckpointManager imports its dataloader module, which imports "
                    "torchdata (not installed here: pip install torchdata)")
    if api.generation() == "moe" and row.ep_mode != "ep":
        missing = api.v02_tp_missing()  # measured where the row runs: what apply_moe_ep_tp's import chain needs
        if missing:
            return (f"torchtitan {api.tt_version()}: its TP plans live in apply_moe_ep_tp ({api.V02_TP_MODULE}), "
                    f"whose imports need {', '.join(missing)} (not installed here: pip install {' '.join(missing)})")
    return None


ADAPTER = Torchtitan()
