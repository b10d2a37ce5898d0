"""torchtitan's release differences, and what a row builds: its MoE module from a tiny config, pointed at the CPU,
parallelized through torchtitan's own code over a mesh of the row's layout.

Generations (read off the installed package, never a version list):
- "common" (0.3): `torchtitan.models.common.moe.MoE` built from configs (`config_utils.make_moe_config`), sharded
  by `set_moe_sharding_config` and its own `Module.parallelize(ParallelDims)` inside torchtitan's spmd context;
  routing scores applied to the experts' outputs (in `combine`). Every layout: EP, TP, EP+TP (SP).
- "moe" (0.2): `torchtitan.models.moe.MoE(MoEArgs)`, scores applied to the experts' inputs
  (`score_before_experts`); EP is `apply_moe_ep_tp`'s EP-only step, `parallelize_module(moe.experts, ep_mesh,
  ExpertParallel())` (apply_moe_ep_tp itself lives in models/llama4/infra/parallelize.py, which imports torchdata
  and tensorboard, not installed here: its TP plans are not driven). Two CPU gaps, bridged in the ranks and named in
  every row (`patch`): `torch.histc` has no integer kernel on CPU (its router counts expert ids with it; the rows
  count them with `torch.bincount`, the same numbers) and its token permutation launches a Triton kernel unless
  `generate_permute_indices(use_cpu=True)`, torchtitan's own CPU path, is used.
- 0.1 has no MoE module outside its experiments (`experiments/llama4`, which imports `datasets`): no rows.
torchtitan's device type falls back to "cuda" when no accelerator is seen (tools/utils.py); `point_at_cpu` sets it
to "cpu" in each module that imported it by value, before a mesh is built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata

from moebench.libraries.torchtitan.shell import one_block_model
from moebench.preload import has_module

HIDDEN = 32
NUM_EXPERTS = 8
EXPERT_HIDDEN = 32
TOP_K = 2
SEQS_PER_DP_RANK, SEQ_LEN = 2, 8
"""Each data-parallel rank's batch: 2 sequences of 8 tokens (split over the TP ranks along the sequence under SP)."""
INIT_STD = 0.1
GATE_STD = 1.0
"""The router's weights are drawn wider than the experts' so that routes are decisive: a token whose top-k is a
near-tie in float32 can flip in bf16 on one side and not the other, which the noise model would read as an error."""

MODULES = {
    "common": ("torchtitan.models.common.moe", "torchtitan.models.common.config_utils",
               "torchtitan.models.common.moe_sharding", "torchtitan.models.common.token_dispatcher",
               "torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils", "torchtitan.tools.utils",
               "torchtitan.models.qwen3.parallelize", "torchtitan.models.deepseek_v3.parallelize"),
    "moe": ("torchtitan.models.moe.moe", "torchtitan.models.moe.utils", "torchtitan.models.moe.kernels",
            "torchtitan.distributed.expert_parallel", "torchtitan.tools.utils"),
}
CPU_MODULES = ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils",
               "torchtitan.models.common.token_dispatcher")
"""The modules that import torchtitan's `device_type` (and `device_module`) by value."""
V02_PATCH = ("torch.histc on expert ids -> torch.bincount (no integer histc on CPU); generate_permute_indices with "
             "use_cpu=True (torchtitan's CPU path, instead of its Triton kernel)")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A row's MoE: its router and whether it has a shared expert (torchtitan's own options); a user row's also its
    number of experts, top-k and the shared expert's width in expert widths (--torchtitan-args)."""

    score_func: str
    route_norm: bool
    route_scale: float
    groups: int | None
    limited_groups: int | None
    shared: bool
    num_experts: int = NUM_EXPERTS
    top_k: int = TOP_K
    shared_mult: int = 1


MODELS = {
    "softmax-top2": ModelSpec("softmax", True, 1.0, None, None, False),
    "sigmoid-grouped+shared": ModelSpec("sigmoid", True, 1.5, 4, 2, True),
}
"""A Mixtral/Qwen-style router, and a DeepSeek-V3-style one (sigmoid, 4 expert groups of which 2 are kept, a scale,
one shared expert)."""


def spec_of(row) -> ModelSpec:
    """The row's MoE: a user row's from its settings (--torchtitan-args), else the named model's."""
    st = row.settings
    if hasattr(st, "experts"):
        return ModelSpec(st.score_func, st.route_norm, st.route_scale, st.groups, st.limited_groups,
                         st.shared_mult > 0, num_experts=st.experts, top_k=st.top_k,
                         shared_mult=max(1, st.shared_mult))
    return MODELS[row.model]


LAYOUTS = {"ep": lambda w: (w, 1, w, False), "tp": lambda w: (1, w, 1, False),
           "ep+tp": lambda w: (w // 2, 2, w, True)}
"""The default rows' layouts -> (dp_shard, tp, ep, sequence parallel) at world size w."""


def degrees(row) -> tuple[int, int, int, bool]:
    """(dp_shard, tp, ep, sequence parallel) of a row: a user row's from its settings, else its named layout's."""
    st = row.settings
    if hasattr(st, "experts"):
        return st.dp, st.tp, st.ep, st.sp
    if generation() == "moe" and row.ep_mode == "tp":  # 0.2's apply_moe_ep_tp: the MoE's input is sequence-sharded
        return 1, row.world_size, 1, True
    return LAYOUTS[row.ep_mode](row.world_size)


def tt_version() -> str | None:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


def generation() -> str | None:
    """"common" (0.3), "moe" (0.2) or None (no MoE module this adapter drives)."""
    if has_module("torchtitan.models.common.moe"):
        return "common"
    if has_module("torchtitan.models.moe.moe"):
        return "moe"
    return None


@functools.lru_cache(maxsize=1)
def load() -> str:
    """Import the generation's modules (imports.py: with the stand-in triton where triton is missing)."""
    from moebench.libraries.torchtitan.imports import import_torchtitan

    gen = generation()
    if gen is None:
        raise RuntimeError(f"torchtitan {tt_version()} has no MoE module this adapter drives")
    import_torchtitan(*MODULES[gen])
    return gen


def point_at_cpu() -> None:
    import importlib
    import sys

    import torch

    for name in CPU_MODULES:
        module = sys.modules.get(name) or (importlib.import_module(name) if has_module(name) else None)
        if module is None:
            continue
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def names(gen: str) -> dict[str, str]:
    """Role -> the module's parameter name."""
    experts = "routed_experts.inner_experts." if gen == "common" else "experts."
    suffix = ({"w1": "w1_EFD", "w2": "w2_EDF", "w3": "w3_EFD"} if gen == "common"
              else {k: k for k in ("w1", "w2", "w3")})
    out = {"gate": "router.gate.weight", **{k: experts + v for k, v in suffix.items()}}
    out.update({f"shared_{k}": f"shared_experts.{k}.weight" for k in ("w1", "w2", "w3")})
    return out


def v02_lacks(model: str) -> str | None:
    """What 0.2's MoEArgs lacks for `model` (0.2.0 has no node-limited routing), or None."""
    from torchtitan.models.moe.moe import MoEArgs

    if MODELS[model].groups and "num_expert_groups" not in {f.name for f in dataclasses.fields(MoEArgs)}:
        return "node-limited routing (MoEArgs.num_expert_groups, 0.2.1+)"
    return None


def score_before_experts(gen: str) -> bool:
    """0.2 scales each routed token's input by its score; 0.3 scales the expert's output."""
    return gen == "moe"


def build(gen: str, model: "str | ModelSpec", enable_ep: bool, enable_sp: bool,
          load_balance_coeff: float | None = None):
    """The row's MoE module in float32 with seeded weights (seed set by the caller): identical on every rank; the
    router's redrawn at GATE_STD. `load_balance_coeff`: torchtitan's aux-loss-free load balancing (its expert bias,
    updated by its optimizers' step pre-hook)."""
    import torch

    moe = _build(gen, model, enable_ep, enable_sp, load_balance_coeff)
    with torch.no_grad():
        torch.nn.init.normal_(moe.router.gate.weight, std=GATE_STD)
    return moe


def _build(gen: str, model: "str | ModelSpec", enable_ep: bool, enable_sp: bool,
           load_balance_coeff: float | None = None):
    import torch

    spec = MODELS[model] if isinstance(model, str) else model
    experts, top_k, shared_hidden = spec.num_experts, spec.top_k, EXPERT_HIDDEN * spec.shared_mult
    if gen == "moe":
        from torchtitan.models.moe.moe import MoE, MoEArgs

        args = dict(num_experts=experts, num_shared_experts=spec.shared_mult if spec.shared else 0,
                    score_func=spec.score_func, route_norm=spec.route_norm, route_scale=spec.route_scale, top_k=top_k,
                    use_grouped_mm=True,
                    load_balance_coeff=load_balance_coeff)
        if spec.groups:  # node-limited routing arrived in 0.2.1 (v02_lacks says which rows skip without it)
            args.update(num_expert_groups=spec.groups, num_limited_groups=spec.limited_groups)
        moe = MoE(MoEArgs(**args), dim=HIDDEN, hidden_dim=EXPERT_HIDDEN)
        with torch.no_grad():  # 0.2's init_weights writes in place into leaves that require grad
            moe.init_weights(INIT_STD, buffer_device=torch.device("cpu"))
        return moe
    import spmd_types as spmd
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_router_config,
        make_token_dispatcher_config,
    )
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    def init(p):
        return torch.nn.init.normal_(p, std=INIT_STD)

    router = make_router_config(dim=HIDDEN, num_experts=experts, gate_param_init={"weight": init}, top_k=top_k,
                                score_func=spec.score_func, route_norm=spec.route_norm, route_scale=spec.route_scale,
                                num_expert_groups=spec.groups, num_limited_groups=spec.limited_groups)
    routed = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=HIDDEN, hidden_dim=EXPERT_HIDDEN, num_experts=experts,
                                            param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init}),
        token_dispatcher=make_token_dispatcher_config(num_experts=experts, top_k=top_k, comm_backend="standard"))
    shared = (make_ffn_config(dim=HIDDEN, hidden_dim=shared_hidden, w1_param_init={"weight": init},
                              w2w3_param_init={"weight": init}) if spec.shared else None)
    cfg = make_moe_config(num_experts=experts, router=router, routed_experts=routed, shared_experts=shared,
                          load_balance_coeff=load_balance_coeff)
    # The experts' TP layout torchtitan's qwen3 / deepseek_v3 pass (moe_sharding.set_moe_sharding_config's docstring).
    set_moe_sharding_config(cfg, enable_ep=enable_ep, enable_sp=enable_sp,
                            expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})
    moe = cfg.build()
    moe.init_states(buffer_device=torch.device("cpu"))
    return moe


def parallel_dims(backend: str, layout: str, world_size: int, degrees: tuple | None = None):
    """torchtitan's ParallelDims of a row's layout, its mesh built: "ep" (EP borrows the dp_shard axis), "tp" (no
    EP), "ep+tp" (dp_shard = W / 2, tp = 2, EP over all W ranks); `degrees` (dp_shard, tp, ep, sp): a user row's."""
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims

    dp, tp, ep = (degrees or LAYOUTS[layout](world_size))[:3]
    key = (backend, dp, tp, ep, world_size, id(dist.group.WORLD))
    if key not in _DIMS:  # one per layout and process group, as a trainer process builds one (see _DIMS)
        dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=ep, world_size=world_size,
                            spmd_backend=backend)
        dims.build_mesh()
        _DIMS[key] = dims
    return _DIMS[key]


_DIMS: dict = {}
"""The ParallelDims built in this rank process. A trainer process builds one; after a second one with the same dense
mesh shape, `Module.parallelize` still places parameters on the first one's SPMD mesh (measured: torch 2.15,
torchtitan 0.3.0), and FSDP over the full SPMD mesh (spmd_types, full_dtensor) refuses them ("Expected param's
DTensor mesh to be the same mesh passed to fully_shard"). Resume sides that share a layout share its ParallelDims;
the --library runner starts fresh ranks for every row."""


def parallelize(gen: str, moe, backend: str, layout: str, world_size: int, degrees: tuple | None = None):
    """Parallelize `moe` the way torchtitan does for the layout; returns (the context its forward runs in, the TP
    degree, how an input enters it, its ParallelDims (None for 0.2)). 0.3: `moe.parallelize(ParallelDims)`
    in torchtitan's spmd context (full_dtensor takes its input as a DTensor, `full_dtensor.parallelize_inputs`;
    spmd_types leaves every state a plain local tensor: `as_dtensor`); 0.2: the EP step of apply_moe_ep_tp."""
    import contextlib

    if gen == "moe":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        if layout == "tp":  # apply_moe_ep_tp itself: TP over every rank, the MoE's input sequence-sharded
            import_v02_tp()
            from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
            apply_moe_ep_tp(one_block_model(moe), tp_mesh=mesh["tp"], ep_mesh=None, etp_mesh=None,
                            ep_etp_mesh=None)
            return contextlib.nullcontext, world_size, _plain, None
        from torchtitan.distributed.expert_parallel import ExpertParallel

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
        parallelize_module(moe.experts, mesh["ep"], ExpertParallel())
        return contextlib.nullcontext, 1, _plain, None
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(backend)
    dims = parallel_dims(backend, layout, world_size, degrees)
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    with context():
        moe.parallelize(dims)
    if backend != "full_dtensor":
        return context, dims.tp, _plain, dims
    return context, dims.tp, _full_dtensor_entry(dims, layout, world_size, degrees), dims


def _plain(x):
    return x


def _full_dtensor_entry(dims, layout: str, world_size: int, degrees: tuple | None):
    """What the MoE's boundary takes under full_dtensor (its in_src_shardings): this rank's tokens as a DTensor of
    the dense mesh, batch-sharded over data parallelism, sequence-sharded over tp under SP, else replicated over tp
    (`full_dtensor.parallelize_inputs` wraps a model's input ids this way, without the SP sequence shard)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sp = (degrees or LAYOUTS[layout](world_size))[3]
    mesh = dims.get_activated_mesh(["dp_replicate", "dp_shard", "cp", "tp"])
    placements = [Shard(0) if axis.startswith("dp") and mesh.size(i) > 1 else Shard(1) if axis == "tp" and
                  sp else Replicate() for i, axis in enumerate(mesh.mesh_dim_names)]
    return lambda x: DTensor.from_local(x, mesh, placements)


V02_TP_MODULE = "torchtitan.models.llama4.infra.parallelize"
"""Where 0.2's apply_moe_ep_tp (its MoE TP plans) lives."""
V02_TP_IMPORTS = ("torchdata", "tensorboard", "datasets")
"""What that module's import chain needs beyond torch and torchtitan's MoE (measured with 0.2.2: its trainer's
dataloader, metrics and validation modules import them); torchtitan 0.2 declares all three."""


def v02_tp_missing() -> list[str]:
    """What 0.2's apply_moe_ep_tp needs that is not importable here (has_module: read off the files)."""
    if not _module_file(V02_TP_MODULE):
        return [V02_TP_MODULE]
    return [m for m in V02_TP_IMPORTS if not has_module(m)]


def _module_file(name: str) -> bool:
    """Whether torchtitan's module `name` is a file of the installed package (its folders may have no __init__.py:
    0.2's models/llama4/infra is a namespace package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        return False
    parts = name.split(".")[1:]
    return any((Path(root).joinpath(*parts[:-1]) / f"{parts[-1]}.py").is_file()
               for root in spec.submodule_search_locations)


def import_v02_tp() -> None:
    from moebench.libraries.torchtitan.imports import import_torchtitan

    import_torchtitan(V02_TP_MODULE)


def as_dtensor(moe, name: str, tensor, dims):
    """A state (or its gradient) of a spmd_types-parallelized module, a plain local tensor, as the DTensor its layout
    says, through torchtitan's own `plain_tensor_to_dtensor_state_dict`; anything else (a DTensor, None, a state of
    another backend's module or of 0.2's) as it is."""
    from torch.distributed.tensor import DTensor

    if dims is None or dims.spmd_backend != "spmd_types" or tensor is None or isinstance(tensor, DTensor):
        return tensor
    from torchtitan.distributed.spmd_types import plain_tensor_to_dtensor_state_dict

    owner, _, leaf = name.rpartition(".")
    module = moe.get_submodule(owner) if owner else moe
    layout = module._sharding_config.state_shardings[leaf]
    return plain_tensor_to_dtensor_state_dict({name: tensor}, state_dict_layouts={name: layout},
                                              parallel_dims=dims)[name]


class _TorchWithIntegerHistc:
    """torch, as 0.2's moe module sees it in a rank: `histc` of integer expert ids counted by `torch.bincount` (the
    same counts: bins of width 1 from 0 to the number of experts); everything else is torch itself."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def histc(self, input, bins=100, min=0, max=0, **kwargs):  # noqa: A002 - torch's own argument names
        if input.is_floating_point():
            return self._torch.histc(input, bins=bins, min=min, max=max, **kwargs)
        return self._torch.bincount(input.reshape(-1), minlength=bins)[:bins].to(input.dtype)


def bridge_v02_cpu_gaps() -> None:
    """0.2 in a rank (V02_PATCH): its moe module's histc on expert ids, and its token permutation's CPU path."""
    import torch
    import torchtitan.models.moe.kernels as kernels
    import torchtitan.models.moe.moe as moe_module
    import torchtitan.models.moe.utils as utils

    moe_module.torch = _TorchWithIntegerHistc(torch)
    utils.generate_permute_indices = functools.partial(kernels.generate_permute_indices, use_cpu=True)
