"""torchtitan 0.3's trainer path: a row's MoE parallelized as `Trainer.__init__` does it, through the model's own
parallelize function (`Module.parallelize`, then `apply_fsdp_to_decoder`'s fully_shard), and what stands between
that path and a CPU with gloo: the torch whose fully_shard cannot take spmd_types' parameters (fsdp_refusal), and
gloo's missing PREMUL_SUM (sum_for_gloo). api.py builds the module and its ParallelDims; bf16.py, resume.py and the
repro template call this.
"""

from __future__ import annotations

import functools
import importlib.metadata

from moebench.libraries.torchtitan import api

PARALLELIZE_FN = {"softmax-top2": "torchtitan.models.qwen3.parallelize:parallelize_qwen3",
                  "sigmoid-grouped+shared": "torchtitan.models.deepseek_v3.parallelize:parallelize_deepseekv3"}
"""The model whose trainer path a default row takes: torchtitan's parallelize function of its Qwen3 (softmax router)
and of its DeepSeek-V3 (sigmoid, grouped, shared expert); a user row's is its --module's (user_setup.py)."""
SPMD_FSDP_TORCH = "2.14"
"""The first torch whose fully_shard takes spmd_types' annotated plain parameters."""


def fsdp_refusal(backend: str) -> str | None:
    """Why torchtitan's trainer cannot apply its FSDP to a `backend` module on the installed torch (None: it can).
    spmd_types leaves plain tensors that FSDP2 turns into DTensors of the full SPMD mesh from torch 2.14 on
    (pytorch/pytorch#181519: `FSDPParam._resolve_spmd_types_for_storage`); torch 2.13's fully_shard refuses them.
    Read off torch's file, never imported (--list asks from threads, where a first torch import may abort)."""
    if backend != "spmd_types" or _fsdp_takes_spmd_types():
        return None
    return (f"its trainer's fully_shard refuses spmd_types' plain parameters on torch {_torch_version()} "
            f"(\"all parameters must be DTensors on the full SPMD mesh\"): torch >= {SPMD_FSDP_TORCH} converts "
            "them (pytorch/pytorch#181519)")


@functools.lru_cache(maxsize=1)
def _fsdp_takes_spmd_types() -> bool:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    source = Path(next(iter(spec.submodule_search_locations)), "distributed", "fsdp", "_fully_shard",
                  "_fsdp_param.py")
    return source.is_file() and "def _resolve_spmd_types_for_storage" in source.read_text(errors="replace")


def refuse(why: str):
    """Raise the row's refusal on every rank: each refuses at the same point, but not at the same instant, and rank 0
    (the store's host) leaving while another still builds FSDP's process groups through the store would break that
    rank's pipe, so every rank meets at a barrier first."""
    import torch.distributed as dist

    from moebench.parity.registry import Refused

    dist.barrier()
    raise Refused(f"torchtitan {api.tt_version()}'s trainer path: {why}")


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def trainer_parallelize(moe, backend: str, layout: str, world_size: int, degrees: tuple | None, fn_path: str,
                        reshard_after_forward: str = "default", param_dtype: str = "bfloat16"):
    """0.3's trainer path: `moe` inside torchtitan's decoder shape (shell.py), handed to the model's own
    parallelize function as `Trainer.__init__` calls it (outside the spmd context; no activation checkpointing, no
    compile): `Module.parallelize(ParallelDims)`, then `apply_fsdp_to_decoder` (fully_shard on the block and the
    root, the meshes from `resolve_fsdp_mesh` / `resolve_sparse_fsdp_mesh` or the dp / efsdp meshes, its
    gradient divide factor 1; `param_dtype`: training.mixed_precision_param, FSDP's compute dtype; the layout's
    ParallelDims is the one this process built for it, api.parallel_dims). Returns (the forward context,
    the TP degree, the input entry, ParallelDims, the shell: call the shell, whose FSDP hooks gather the parameters
    and reduce the gradients)."""
    import importlib
    import tempfile

    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(backend)
    dims = api.parallel_dims(backend, layout, world_size, degrees)
    shell = api.one_block_model(moe)
    module, _, name = fn_path.partition(":")
    fn = getattr(importlib.import_module(module), name)
    parallelism = ParallelismConfig(spmd_backend=backend, fsdp_reshard_after_forward=reshard_after_forward)
    with tempfile.TemporaryDirectory() as dump:
        fn(shell, parallel_dims=dims, training=TrainingConfig(mixed_precision_param=param_dtype),
           parallelism=parallelism, compile_config=CompileConfig(), ac_config=None, dump_folder=dump)
    sum_for_gloo(shell)
    entry = api._plain if backend != "full_dtensor" else api._full_dtensor_entry(dims, layout, world_size, degrees)
    return dist_utils.get_spmd_context(parallel_dims=dims), dims.tp, entry, dims, shell


def sum_for_gloo(model) -> None:
    """The rows' `gloo` stand-in, under a gloo process group only: FSDP2 asks for PREMUL_SUM(1 / 1) once torchtitan
    sets its divide factor to 1, gloo refuses it, and FSDP's own force-sum switch reduces with SUM and divides by 1
    (a no-op)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
