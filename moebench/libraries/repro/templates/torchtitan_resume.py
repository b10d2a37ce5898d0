"""Reproduce a torchtitan resume row (named above): its MoE parallelized as its trainer does it (DeepSeek-V3's own
parallelize function: Module.parallelize, then fully_shard), trained through its OptimizersContainer (with its
load-balancing hook), saved and loaded by its own CheckpointManager over DCP, then every expert slot of every rank
compared with every global expert's state at the save.

Standalone (stdlib, torch, torchtitan and spmd_types; triton where installed, else an import stand-in). Exit 1: a slot
holds another expert's (or no expert's) state; 0: every slot restored bit for bit; 2: a setup error, a refused load
or the deadline."""
from __future__ import annotations  # the pasted files' annotations name types this script never builds

import json
import sys
import traceback

SETTINGS = json.loads('{"world": 2}')  # @SETTINGS@ (filled by moebench)
S = SETTINGS
DEADLINE_S = 600.0
MODULES = ("torchtitan.models.common.moe", "torchtitan.models.common.config_utils",
           "torchtitan.models.common.moe_sharding", "torchtitan.models.common.token_dispatcher",
           "torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils", "torchtitan.tools.utils",
           "torchtitan.components.checkpoint", "torchtitan.components.optimizer.optimizer",
           "torchtitan.distributed.spmd_types", "torchtitan.models.deepseek_v3.parallelize")
CPU_MODULES = ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils",
               "torchtitan.models.common.token_dispatcher")

# @TRITON@ (moebench/libraries/triton_standin.py: the stand-in triton its imports use)
# @TTIMPORTS@ (moebench/libraries/torchtitan/imports.py: torchtitan imported with a stand-in triton where missing)

# @TTEXCHANGE@ (moebench/libraries/torchtitan/exchange.py: spmd_types' uneven all_to_all padded for gloo)

# @RESTORE@ (moebench/parity/restore.py: which expert's state each slot holds)


DIMS = {}


def build(layout, seed):
    """torchtitan's MoE (DeepSeek-V3's router: sigmoid, grouped top-k, a shared expert, load balancing), its own
    config utilities, parallelized by its own Module protocol over the layout; returns (model, moe, opt, dims)."""
    import spmd_types as spmd
    import torch
    from torchtitan.components.optimizer.optimizer import (
        OptimizersContainer,
        ParamGroupConfig,
        register_moe_load_balancing_hook,
    )
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_router_config,
        make_token_dispatcher_config,
    )
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    h, e, k, std = S["hidden"], S["experts"], S["top_k"], S["init_std"]
    torch.manual_seed(seed)

    def init(p):
        return torch.nn.init.normal_(p, std=std)

    router = make_router_config(dim=h, num_experts=e, gate_param_init={"weight": init}, top_k=k, score_func="sigmoid",
                                route_norm=True, route_scale=1.5, num_expert_groups=4, num_limited_groups=2)
    routed = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=h, hidden_dim=S["expert_hidden"], num_experts=e,
                                            param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init}),
        token_dispatcher=make_token_dispatcher_config(num_experts=e, top_k=k, comm_backend="standard"))
    shared = make_ffn_config(dim=h, hidden_dim=S["expert_hidden"], w1_param_init={"weight": init},
                             w2w3_param_init={"weight": init})
    cfg = make_moe_config(num_experts=e, router=router, routed_experts=routed, shared_experts=shared,
                          load_balance_coeff=S["load_balance_coeff"])
    set_moe_sharding_config(cfg, enable_ep=layout != "tp", enable_sp=False,
                            expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})
    moe = cfg.build()
    moe.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():
        torch.nn.init.normal_(moe.router.gate.weight, std=S["gate_std"])
    world = S["world"]
    dp, tp, ep = (world, 1, world) if layout == "ep" else (1, world, 1)
    dist_utils.set_spmd_backend(S["backend"])
    if layout not in DIMS:  # one ParallelDims per layout, as a trainer process has one (FSDP checks the mesh)
        DIMS[layout] = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=ep, world_size=world,
                                    spmd_backend=S["backend"])
        DIMS[layout].build_mesh()
    dims = DIMS[layout]

    class Block(torch.nn.Module):
        moe_enabled = True

        def __init__(self):
            super().__init__()
            self.moe = moe

        def forward(self, x):
            return self.moe(x)

    class Model(torch.nn.Module):  # torchtitan's Decoder as its parallelize function reads it, one MoE block
        enable_weight_tying = False
        tok_embeddings = norm = lm_head = mtp_layers = None

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": Block()})

        def parallelize(self, parallel_dims):
            moe.parallelize(parallel_dims)

        def forward(self, x):
            return self.layers["0"](x)

    import tempfile

    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    model = Model()
    with tempfile.TemporaryDirectory() as dump:  # as Trainer.__init__ calls it (no AC, no compile)
        parallelize_deepseekv3(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                               parallelism=ParallelismConfig(spmd_backend=S["backend"]),
                               compile_config=CompileConfig(), ac_config=None, dump_folder=dump)
    for module in model.modules():  # gloo has no PREMUL_SUM (FSDP's pick for divide factor 1): SUM, the same numbers
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    config = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="Adam",
                                                                       optimizer_kwargs={"lr": S["lr"]})],
                                        implementation="for-loop")
    opt = OptimizersContainer(config, model_parts=[model])
    register_moe_load_balancing_hook(opt, [model], dims)
    return model, moe, opt, dims, context


def checkpointer(folder, model, opt):
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, initial_load_model_only=False,
                                      exclude_from_loading=["dataloader", "lr_scheduler"])
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=None,
                             states={}, sd_adapter=None, base_folder=folder)


def train(side, step, rank):
    import torch
    from torch.distributed.tensor import DTensor

    model, moe, opt, dims, context = side
    world, seqs, seq_len = S["world"], S["seqs_per_rank"], S["seq_len"]
    g = torch.Generator().manual_seed(S["seed"] * 1000 + step)
    x = torch.randn(world * seqs, seq_len, S["hidden"], generator=g)
    t = torch.randn(world * seqs, seq_len, S["hidden"], generator=g)
    mine = slice(rank * seqs, (rank + 1) * seqs)
    with context():
        y = model(x[mine].clone())  # FSDP's hooks gather the parameters and reduce the gradients
        y = y.to_local() if isinstance(y, DTensor) else y
        ((y.float() * t[mine]).sum() / (x.shape[0] * x.shape[1])).backward()
    opt.step()
    opt.zero_grad()


def whole(moe, name, t, dims):
    """A state of the module as one whole tensor (a spmd_types state through torchtitan's own conversion)."""
    from torch.distributed.tensor import DTensor

    if S["backend"] == "spmd_types" and not isinstance(t, DTensor):
        from torchtitan.distributed.spmd_types import plain_tensor_to_dtensor_state_dict

        owner, _, leaf = name.rpartition(".")
        layout = (moe.get_submodule(owner) if owner else moe)._sharding_config.state_shardings[leaf]
        t = plain_tensor_to_dtensor_state_dict({name: t}, state_dict_layouts={name: layout}, parallel_dims=dims)[name]
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def state(side):
    model, moe, opt, dims, _ = side
    out = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in moe.named_parameters():
        out["weights"][name] = whole(moe, name, p, dims)
        st = next((o.state[p] for o in opt.optimizers if p in o.state), {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                out[key][name] = whole(moe, name, st[key], dims)
    return out


def rank_main(rank, store_path, folder, deadline, queue):
    try:
        import logging
        import warnings

        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", message="To construct DTensor from torch.Tensor")
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        rank_group(rank, S["world"], store_path, deadline)  # noqa: F821 - pasted above (RESUMEDRIVER)
        import_torchtitan(*MODULES)  # noqa: F821 - pasted above (TTIMPORTS)
        import importlib

        for module_name in CPU_MODULES:  # torchtitan's device falls back to "cuda" without an accelerator
            module = importlib.import_module(module_name)
            if hasattr(module, "device_type"):
                module.device_type = "cpu"
            if hasattr(module, "device_module"):
                module.device_module = torch.cpu
        if S["backend"] == "spmd_types":
            bridge()  # noqa: F821 - pasted above (TTEXCHANGE)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # FSDP's gather hints
        a = build("ep", S["seed"])
        for step in range(S["save_steps"]):
            train(a, step, rank)
        saved = state(a)
        checkpointer(folder, a[0], a[2]).save(curr_step=S["save_steps"])
        dist.barrier()
        b = build(S["load_ep_mode"], S["seed"] + 7919)
        try:
            checkpointer(folder, b[0], b[2]).load(step=S["save_steps"])
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            queue.put((rank, "refused", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"))
            return
        now = state(b)
        local = S["experts"] // S["world"]
        held = range(rank * local, (rank + 1) * local) if S["load_ep_mode"] != "tp" else (
            range(S["experts"]) if rank == 0 else [])
        findings = []
        names = {"weights": WEIGHTS, "exp_avg": EXP_AVG, "exp_avg_sq": EXP_AVG_SQ}  # noqa: F821 (RESTORE)
        for key, quantity in names.items():
            for name, got in now[key].items():
                if "inner_experts" not in name:
                    continue
                want = {g: saved[key][name][g] for g in range(S["experts"])}
                for slot, g in enumerate(held):
                    where = Slot(rank=rank, local=slot if S["load_ep_mode"] != "tp" else g, unit=g)  # noqa: F821
                    findings.append(identify(where, quantity, got[g], want))  # noqa: F821
        queue.put((rank, "findings", findings))
    except BaseException:  # noqa: BLE001 - every error reaches the parent
        queue.put((rank, "error", traceback.format_exc()))


# @RESUMEDRIVER@ (templates/resume_driver.py: the ranks spawned, waited for and killed; the finding printed)


def main():
    restored = f"every expert slot of every rank restored bit for bit (torchtitan, spmd_backend={S['backend']})"
    return restore_main(rank_main, S["world"], DEADLINE_S, restored)  # noqa: F821 - pasted above (RESUMEDRIVER)

if __name__ == "__main__":
    sys.exit(main())
