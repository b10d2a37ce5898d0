"""NVIDIA NeMo Automodel: its MoE block, alone and inside two of its model families (DeepSeek-V3, Qwen3-MoE), with
its own `apply_ep` over the W ranks and its trainer's gradient convention, against the same model on one process.

On a CPU, Automodel's `BackendConfig` picks the "torch" experts (a per-expert loop) and the "torch" dispatcher:
every rank all-gathers the tokens and their routing weights (a differentiable variable-length all-gather), runs its
own experts on all of them, and an all-reduce returns each rank its tokens' output. `apply_ep` shards the experts'
stacked weights over the "ep" mesh (DTensor Shard(0): rank r holds experts r*E/W ..). Rows (parity.py has what a
row compares and how): the block and each family, with the loop and with torch._grouped_mm experts, with and
without a clip that binds. Transformer Engine's grouped experts and the DeepEP dispatcher need CUDA:
skip rows with the reason. Release differences: api.py.

`--recipe FILE` / `--hf-config FILE` replace the matrix by the rows of the user's own setup: user_setup.py reads
the recipe through Automodel's own loader (recipe.py) and the config.json through transformers, and fits them to the
rows (fit.py); user_rows.py defines the rows, user_run.py runs them through user_step.py (Automodel's own meshes
and parallelizer, its trainer's step, accumulation, clip and bias update).

The package's files: __init__.py the adapter (rows, what cannot run here, the releases); api.py what a row builds
and the release differences; parity.py the rows' comparisons and known-wrong references; resume.py the resume rows;
user_setup.py, recipe.py, fit.py, user_rows.py, user_step.py and user_run.py the user's own setup.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from moebench.libraries import pins
from moebench.libraries.automodel import api, compat
from moebench.libraries.automodel.releases import COMPATIBILITY
from moebench.libraries.spec import BF16, PARITY, RESUME, Adapter, Emulated, Row, Settings
from moebench.parity.diagnosis import REDUCTION_MECHANISMS, REPLICATED, ROUTER

NAME = "automodel"
EP_MODE = "apply_ep"
USER = "recipe"
"""The kind of a row of the user's own setup in float32 (user_rows.KIND; its bf16 row is spec.BF16)."""
SHARED_EXPERTS = ("block", "deepseek_v3")
"""The rows whose MoE block has a shared expert."""
CLIP = {"block": 0.02, "deepseek_v3": 0.2, "qwen3_moe": 0.2}
"""max_grad_norm of the clip rows: below each model's step-1 gradient norm at every seed (the row asserts it binds)."""
PRELOAD = (
    "nemo_automodel.components.moe.layers", "nemo_automodel.components.moe.parallelizer",
    "nemo_automodel.components.moe.config", "nemo_automodel.components.training.utils",
    "nemo_automodel.components.models.common.utils", "nemo_automodel.components.models.qwen3_moe.model",
    "nemo_automodel.components.models.deepseek_v3.model", "transformers", "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
)
"""Imported once in the parent (~6 s here), inherited by every forked rank."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutomodelSettings(Settings):
    max_grad_norm: float | None
    """Clip rows: Automodel's clip_grad_norm with the EP mesh at this norm; None: no clip (the scaling still runs)."""
    dense_grads: str = "averaged over the ranks (FSDP's reduce, emulated)"
    """How the non-expert gradients are reduced: FSDP itself is not applied."""
    patch: str = ""
    """What the row patches in its ranks to build on CPU torch ("" : nothing)."""
    torch_compile: str = api.TORCH_COMPILE
    """How the library's torch.compile'd functions run in the ranks."""

    def emulated(self) -> tuple[Emulated, ...]:
        if "emulated" not in self.dense_grads:
            return ()
        return (Emulated(piece="Automodel's FSDP reduce of the non-expert gradients", groups=(ROUTER, REPLICATED),
                         mechanisms=REDUCTION_MECHANISMS),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutomodelResumeSettings(Settings):
    save_steps: int
    continue_steps: int
    load_ep_mode: str = "apply_ep+fsdp"
    """The layout the checkpoint is loaded under: the saved one, or "fsdp" (no EP: FSDP shards the experts)."""
    save_ep: int = 0
    """The EP degree the checkpoint is saved under (0: every rank); loaded under EP over every rank (DCP reshards)."""
    dense_grads: str = "averaged over the ranks by apply_fsdp (FSDP2), as the recipes parallelize"
    checkpoint: str = "Checkpointer.save_model / save_optimizer / load_model / load_optimizer, torch_save (DCP)"
    torch_compile: str = api.TORCH_COMPILE


def settings(model: str, clip: bool) -> AutomodelSettings:
    return AutomodelSettings(max_grad_norm=CLIP[model] if clip else None,
                             patch=api.QWEN3_PATCH if model == "qwen3_moe" else "")


class Automodel(Adapter):
    """NeMo Automodel's MoE under its own apply_ep (see the module docstring)."""

    name = NAME
    compatibility = COMPATIBILITY
    import_name = "nemo_automodel"
    dist_name = "nemo-automodel"
    extra = "automodel"
    catches = ("an Automodel EP path (its all-gather, its gradient scaling or its clip norm) whose outputs, "
               "gradients or weights differ from one process")
    preload = PRELOAD
    runners = {PARITY: "moebench.libraries.automodel.parity:run", RESUME: "moebench.libraries.automodel.resume:run",
               USER: "moebench.libraries.automodel.user_run:run", BF16: "moebench.libraries.automodel.user_run:run"}
    timeout_s = 180.0

    def install_hint(self) -> str:
        return pins.no_deps_command(self.dist_name, self.extra)

    def version(self) -> str | None:
        return api.am_version()

    def unavailable(self) -> str | None:
        if importlib.util.find_spec(self.import_name) is None or api.am_version() is None:
            return f"not installed: {self.install_hint()}"
        # its MoE layers' folder, looked up on disk: finding a submodule's spec would run nemo_automodel's
        # __init__ (0.6 s of torch.distributed imports) in --list
        if not any(os.path.isdir(os.path.join(folder, "components", "moe"))
                   for folder in importlib.util.find_spec(self.import_name).submodule_search_locations or ()):
            return f"nemo-automodel {api.am_version()} has no components.moe (its MoE layers): {self.install_hint()}"
        return None


    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        """The matrix at `world_size`; with `user_config` (--recipe / --hf-config: user_setup.py) the rows of the
        user's own setup instead (user_rows.py)."""
        if world_size < 2:  # apply_ep asserts an EP mesh of 2 or more ranks
            return []
        if user_config is not None:
            from moebench.libraries.automodel.user_rows import user_rows

            return user_rows(world_size, dict(user_config))

        def row(model, backend, clip=False):
            return Row(library=NAME, model=model, backend=backend, ep_mode=EP_MODE, world_size=world_size,
                       settings=settings(model, clip), features=("loss-curve", "clip") if clip else ("loss-curve",),
                       variant="clip" if clip else "")

        rows = [row(model, backend, clip) for model in api.MODELS for clip in (False, True)
                for backend in api.BACKENDS]
        rows += [row("block", backend) for backend in api.CUDA_BACKENDS]
        if resume:  # save -> load -> continue through Automodel's own Checkpointer (resume.py)
            from moebench.libraries.automodel.resume import CONTINUE_STEPS, SAVE_STEPS

            rows += [Row(library=NAME, model="deepseek_v3", backend=backend, ep_mode="apply_ep+fsdp",
                         world_size=world_size, kind=RESUME, features=("resume",), variant="resume",
                         settings=AutomodelResumeSettings(save_steps=SAVE_STEPS, continue_steps=CONTINUE_STEPS))
                     for backend in api.BACKENDS]
            rows.append(Row(library=NAME, model="deepseek_v3", backend="torch_mm", ep_mode="apply_ep+fsdp",
                            world_size=world_size, kind=RESUME, features=("resume",), variant="resume-to-noep",
                            settings=AutomodelResumeSettings(save_steps=SAVE_STEPS, continue_steps=0,
                                                             load_ep_mode="fsdp")))
            if world_size >= 4 and world_size % 2 == 0:  # EP W/2 -> W: Automodel reshards through DCP
                half = world_size // 2
                rows.append(Row(library=NAME, model="deepseek_v3", backend="torch_mm", ep_mode="apply_ep+fsdp",
                                world_size=world_size, kind=RESUME, features=("resume",),
                                variant=f"resume-ep{half}-to-ep{world_size}",
                                settings=AutomodelResumeSettings(save_steps=SAVE_STEPS, continue_steps=0,
                                                                 save_ep=half)))
        return rows

    def skip_reason(self, row: Row) -> str | None:
        return skip_reason(row)

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing a resume row's save and load (templates/automodel_resume.py: torch,
        transformers and nemo_automodel); None for the other rows."""
        if row.kind != RESUME or skip_reason(row) is not None:
            return None
        from moebench.libraries.automodel.resume import LR, SAVE_STEPS
        from moebench.libraries.repro import fill

        s = row.settings
        settings = {"world": row.world_size, "seed": seed, "backend": row.backend,
                    "save_ep": s.save_ep or row.world_size,
                    "load_ep": 1 if s.load_ep_mode == "fsdp" else row.world_size,
                    "hidden": api.HIDDEN, "expert_intermediate": api.EXPERT_INTERMEDIATE, "top_k": api.TOP_K,
                    "experts": api.NUM_EXPERTS, "vocab": api.VOCAB, "lr": LR, "save_steps": SAVE_STEPS,
                    "seqs_per_rank": api.SEQS_PER_RANK, "seq_len": api.SEQ_LEN}
        return fill("automodel_resume", settings, key=row.key())


def skip_reason(row: Row) -> str | None:
    """One line why this row cannot run here, or None."""
    import torch

    if row.kind in (USER, BF16, RESUME):  # these rows parallelize through Automodel's own parallelizer
        breaks = compat.fsdp_patch_breaks()
        if breaks:
            return breaks
    if row.kind in (USER, BF16):
        return _user_skip_reason(row)

    if row.backend == "te":
        return ("GroupedExpertsTE needs Transformer Engine and a CUDA GPU (without CUDA Automodel's BackendConfig "
                "rewrites experts='te' to 'torch_mm', the torch_mm row)") if not torch.cuda.is_available() else (
            "the te experts are not covered by this adapter (CPU ranks only)")
    if row.backend == "deepep":
        return ("the DeepEP dispatcher (GroupedExpertsDeepEP) needs DeepEP or UCCL-EP kernels and a CUDA GPU"
                if not torch.cuda.is_available() else "the DeepEP dispatcher is not covered by this adapter")
    if row.model not in api.MODELS or row.backend not in api.BACKENDS:
        return f"unknown Automodel row {row.model}/{row.backend}"
    if row.world_size < 2 or api.NUM_EXPERTS % row.world_size:
        return f"{api.NUM_EXPERTS} experts do not split over {row.world_size} EP ranks (apply_ep needs >= 2)"
    if row.backend != "torch" and "experts" not in api.backend_fields():
        return (f"nemo-automodel {api.am_version()} has one experts implementation, the per-expert loop "
                f"(no {row.backend})")
    if row.model in SHARED_EXPERTS and api.shared_experts_need_cuda():
        return (f"nemo-automodel {api.am_version()}'s MoE.forward runs the shared experts on a torch.cuda.Stream, "
                "which CPU torch cannot create")
    return None


def _user_skip_reason(row: Row) -> str | None:
    """Why a row of the user's setup cannot run here (a release without the experts backend, or one that runs the
    shared experts on a CUDA stream), or None."""
    if importlib.util.find_spec("nemo_automodel.recipes._dist_utils") is None:
        return (f"nemo-automodel {api.am_version()} has no recipes/_dist_utils.py (create_distributed_setup_from_"
                "config, from 0.5): the rows of a recipe build Automodel's own meshes with it")
    if row.backend != "torch" and "experts" not in api.backend_fields():
        return (f"nemo-automodel {api.am_version()} has one experts implementation, the per-expert loop "
                f"(no {row.backend})")
    if row.settings.n_shared_experts and api.shared_experts_need_cuda():
        return (f"nemo-automodel {api.am_version()}'s MoE.forward runs the shared experts on a torch.cuda.Stream, "
                "which CPU torch cannot create")
    return None


ADAPTER = Automodel()
