"""Reproduce a NeMo Automodel resume row (named above): its DeepSeek-V3 model (grouped top-k, a shared expert, the
routing bias its gate updates every step) parallelized by Automodel's own parallelizer from a recipe's `distributed:`
section, trained as its train_ft recipe steps, saved and loaded by its own Checkpointer over DCP, then every expert
slot of every rank compared with every global expert's state at the save, and the routing bias with its own.

Standalone (stdlib, torch, transformers and nemo_automodel). Exit 1: a slot holds another expert's (or no expert's)
state, or the routing bias is not the saved one; 0: every slot restored bit for bit; 2: a setup error, a refused
load or the deadline."""
from __future__ import annotations  # the pasted files' annotations name types this script never builds

import json
import os
import sys
import traceback

SETTINGS = json.loads('{"world": 2}')  # @SETTINGS@ (filled by moebench)
S = SETTINGS
DEADLINE_S = 600.0
BIAS = "e_score_correction_bias"

# @RESTORE@ (moebench/parity/restore.py: which expert's state each slot holds)


def build(ep_size, seed):
    """The row's model as moebench builds it (tiny DeepSeek-V3 config, seeded weights: the same on every rank),
    parallelized by Automodel's own parallelizer; returns (model, Adam, its MoE mesh or None)."""
    import torch
    import transformers as hf
    from nemo_automodel.components.models.deepseek_v3.model import DeepseekV3ForCausalLM
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config

    try:
        from nemo_automodel.components.models.common.utils import BackendConfig
    except ImportError:  # before 0.6: beside the MoE layers
        from nemo_automodel.components.moe.utils import BackendConfig
    fields = set(getattr(BackendConfig, "__dataclass_fields__", {}))
    wanted = dict(experts=S["backend"], dispatcher="torch", attn="sdpa", linear="torch", rms_norm="torch",
                  rope_fusion=False, enable_hf_state_dict_adapter=False)
    if "experts" not in fields:  # 0.2 picks DeepEP by this flag (later releases warn that it is ignored)
        wanted["enable_deepep"] = False
    backend = BackendConfig(**{k: v for k, v in wanted.items() if k in fields})
    torch.manual_seed(seed)
    h, inter = S["hidden"], S["expert_intermediate"]
    config = hf.DeepseekV3Config(hidden_size=h, intermediate_size=2 * inter, moe_intermediate_size=inter,
                                 num_experts_per_tok=S["top_k"], num_hidden_layers=1, vocab_size=S["vocab"],
                                 max_position_embeddings=64, tie_word_embeddings=False, dtype=torch.float32,
                                 n_routed_experts=S["experts"], n_shared_experts=1, n_group=4, topk_group=2,
                                 first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4,
                                 q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                 v_head_dim=8, routed_scaling_factor=1.5)
    model = DeepseekV3ForCausalLM(config, backend=backend)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    section = {"strategy": "fsdp2", "ep_size": ep_size, "activation_checkpointing": False,
               "mp_policy": {"param_dtype": "float32", "reduce_dtype": "float32", "output_dtype": "float32"}}
    setup = create_distributed_setup_from_config(section, world_size=S["world"])
    mesh = getattr(setup, "mesh_context", setup)
    try:
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

        parallelize_model(model, mesh)
    except ImportError:  # before 0.7: the MoE parallelizer with the mesh's axis names
        import inspect

        from nemo_automodel.components.moe.parallelizer import parallelize_model
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs = dict(mesh.parallelize_axis_kwargs(), activation_checkpointing=False,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                     output_dtype=torch.float32))
        accepted = inspect.signature(parallelize_model).parameters
        parallelize_model(model, mesh.device_mesh, mesh.moe_mesh, **{k: v for k, v in kwargs.items() if k in accepted})
    moe_mesh = mesh.moe_mesh if ep_size > 1 else None
    return model, torch.optim.Adam(model.parameters(), lr=S["lr"], foreach=False), moe_mesh


def checkpointer(folder, rank, mesh):
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    config = CheckpointingConfig(checkpoint_dir=folder, model_save_format="torch_save", save_consolidated=False,
                                 model_repo_id=None, model_cache_dir=folder)
    return Checkpointer(config, dp_rank=rank, tp_rank=0, pp_rank=0, moe_mesh=mesh)


def train(side, step, rank):
    """One step as train_ft takes it: (loss * dp).backward(), scale_grads_and_clip_grad_norm, Adam, the bias update."""
    import inspect

    import torch
    import torch.nn.functional as F
    from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler
    from nemo_automodel.components.training import utils

    model, opt, mesh = side
    world, seqs, seq_len, vocab = S["world"], S["seqs_per_rank"], S["seq_len"], S["vocab"]
    g = torch.Generator().manual_seed(S["seed"] * 1000 + step)
    inputs = torch.randint(vocab, (world * seqs, seq_len), generator=g)
    targets = torch.randint(vocab, (world * seqs, seq_len), generator=g)
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    mine = slice(rank * seqs, (rank + 1) * seqs)
    out = model(inputs[mine])
    logits = getattr(out, "logits", out)
    loss = F.cross_entropy(logits.reshape(-1, vocab).float(), targets[mine].reshape(-1), reduction="sum")
    (loss / targets.numel() * world).backward()
    fn = utils.scale_grads_and_clip_grad_norm
    kwargs = dict(moe_mesh=mesh, ep_axis_name="ep", dp_group_size=world, pp_enabled=False, foreach=True)
    fn(None, [model], **{k: v for k, v in kwargs.items() if k in inspect.signature(fn).parameters})
    opt.step()
    opt.zero_grad()
    if hasattr(model, "update_moe_gate_bias"):
        model.update_moe_gate_bias()


def whole(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def state(side):
    from nemo_automodel.components.moe.layers import MoE

    model, opt, _ = side
    out = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in model.named_parameters():
        if ".experts." not in name:
            continue
        out["weights"][name] = whole(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in opt.state.get(p, {}):
                out[key][name] = whole(opt.state[p][key])
    gate = next(m for m in model.modules() if isinstance(m, MoE)).gate
    out["bias"] = whole(getattr(gate, BIAS))
    return out


def rank_main(rank, store_path, folder, deadline, queue):
    try:
        import warnings

        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore")
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # its deprecation lines for the tiny config
        rank_group(rank, S["world"], store_path, deadline)  # noqa: F821 - pasted above (RESUMEDRIVER)
        torch.compiler.set_stance("force_eager")  # Automodel's compiled activations, run eagerly (the same math)
        a = build(S["save_ep"], S["seed"])
        for step in range(S["save_steps"]):
            train(a, step, rank)
        saved = state(a)
        path = os.path.join(folder, f"step_{S['save_steps']}")
        checkpointer(folder, rank, a[2]).save_model(a[0], path)
        checkpointer(folder, rank, a[2]).save_optimizer(a[1], a[0], path)
        dist.barrier()
        b = build(S["load_ep"], S["seed"] + 7919)
        try:
            loader = checkpointer(folder, rank, b[2])
            loader.load_model(b[0], os.path.join(path, "model"))
            loader.load_optimizer(b[1], b[0], path)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            queue.put((rank, "refused", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"))
            return
        now = state(b)
        experts = S["experts"]
        local = experts // S["load_ep"] if S["load_ep"] > 1 else experts
        held = range(rank * local, (rank + 1) * local) if S["load_ep"] > 1 else (range(experts) if rank == 0 else [])
        findings = []
        names = {"weights": WEIGHTS, "exp_avg": EXP_AVG, "exp_avg_sq": EXP_AVG_SQ}  # noqa: F821 (RESTORE)
        for key, quantity in names.items():
            for name, got in now[key].items():
                want = {e: saved[key][name][e] for e in range(experts)}
                for slot, e in enumerate(held):
                    where = Slot(rank=rank, local=slot if S["load_ep"] > 1 else e, unit=e)  # noqa: F821
                    findings.append(identify(where, quantity, got[e], want))  # noqa: F821
        findings.append(identify(Slot(rank=rank, local=None, unit=BIAS), WEIGHTS, now["bias"],  # noqa: F821
                                 {BIAS: saved["bias"]}))
        queue.put((rank, "findings", findings))
    except BaseException:  # noqa: BLE001 - every error reaches the parent
        queue.put((rank, "error", traceback.format_exc()))


# @RESUMEDRIVER@ (templates/resume_driver.py: the ranks spawned, waited for and killed; the finding printed)


def main():
    restored = ("every expert slot of every rank and the routing bias restored bit for bit (NeMo Automodel, "
                f"ep_size {S['save_ep']} -> {S['load_ep']})")
    return restore_main(rank_main, S["world"], DEADLINE_S, restored)  # noqa: F821 - pasted above (RESUMEDRIVER)

if __name__ == "__main__":
    sys.exit(main())
