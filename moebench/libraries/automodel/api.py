"""NeMo Automodel's release differences and what a row builds: its MoE block (in the two-level wrapper `apply_ep`
walks) or one of its model families from a tiny config, its EP mesh, and its trainer's gradient calls.

Release differences (read off the installed code, never a version list):
- `scale_grads_and_clip_grad_norm` takes `grad_norm_backend` from 0.7 and `expert_tp_replication_factor` from 0.6:
  keyword arguments are passed only when the installed signature has them;
- the EP all-gather of the routing weights is differentiable from 0.6 (0.5.0 gathers them with
  `differentiable=False`: the row's finding, not something the adapter papers over);
- `GroupedExperts._gather_ep_inputs` (where 0.7 gathers) does not exist before 0.7: the gather is inline in
  `forward` (0.2-0.3: `DTensor.from_local(Shard(0)).full_tensor()`, 0.4-0.6: `_AllGatherConcatVarlenFn`);
- 0.2-0.3 run the shared experts on a `torch.cuda.Stream` created in `MoE.forward`: rows whose block has shared
  experts (the block, DeepSeek-V3) skip there with that reason; Qwen3-MoE has none and runs;
- 0.2 keeps `BackendConfig` and `MoEConfig` beside the MoE layers (moe/utils.py, moe/layers.py), and has no
  `experts` backend: the per-expert loop only (the torch_mm rows skip there).
Every release builds the Qwen3-MoE model's rotary embedding on `cuda:<torch.cuda.current_device()>`
(qwen3_moe/model.py), which CPU torch refuses: the row builds it with `torch.cuda.current_device` answering 0, in
the rank only, and says so in its settings (`patch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import inspect
from typing import Any

MODELS = ("block", "deepseek_v3", "qwen3_moe")
"""The MoE block alone (`moe.layers.MoE`) and two model families with the same block inside."""
BACKENDS = ("torch", "torch_mm")
"""CPU expert backends: the per-expert loop ("torch") and torch._grouped_mm ("torch_mm")."""
CUDA_BACKENDS = ("te", "deepep")
"""Transformer Engine's grouped experts and the DeepEP dispatcher: CUDA only (skip rows)."""

HIDDEN = 32
NUM_EXPERTS = 8
TOP_K = 2
EXPERT_INTERMEDIATE = 32
VOCAB = 32
TOKENS_PER_RANK = 16
"""Block rows: each rank's tokens (16 x top-2 = 32 routed slots per rank over 8 experts)."""
SEQS_PER_RANK, SEQ_LEN = 2, 8
"""Model rows: each rank's sequences (16 tokens)."""
TORCH_COMPILE = ("force_eager: Automodel's torch.compile'd SwiGLU runs as plain torch in the ranks (the same "
                 "mathematics; compiling it costs ~4 s a rank a row on 2 CPU cores)")
QWEN3_PATCH = ("torch.cuda.current_device -> 0 while the model is built (qwen3_moe/model.py builds its rotary "
               "embedding on cuda:<current_device>; initialize_weights(buffer_device=cpu) moves it back)")


def am_version() -> str | None:
    try:
        return importlib.metadata.version("nemo-automodel")
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int]:
    major, _, rest = version.partition(".")
    minor = "".join(ch for ch in rest.partition(".")[0] if ch.isdigit())
    return int(major or 0), int(minor or 0)


def accepted(fn, **kwargs: Any) -> dict[str, Any]:
    """`kwargs` less those the installed `fn` does not take (a keyword added in a later release)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _backend_class():
    try:
        from nemo_automodel.components.models.common.utils import BackendConfig
    except ImportError:  # 0.2: beside the MoE layers
        from nemo_automodel.components.moe.utils import BackendConfig
    return BackendConfig


def backend_fields() -> set[str]:
    """The installed BackendConfig's fields (0.2 has no `experts` / `dispatcher`: the per-expert loop only)."""
    return {f.name for f in dataclasses.fields(_backend_class())}


def backend_config(experts: str):
    """The CPU backends, in the fields the installed release has."""
    fields = backend_fields()
    wanted = dict(experts=experts, dispatcher="torch", attn="sdpa", linear="torch", rms_norm="torch",
                  rope_fusion=False, enable_hf_state_dict_adapter=False)
    if "experts" not in fields:  # 0.2 picks DeepEP by this flag (later releases only warn that it is ignored)
        wanted["enable_deepep"] = False
    return _backend_class()(**{k: v for k, v in wanted.items() if k in fields})


class Block:
    """The lone MoE block inside the two levels `apply_ep` walks (`model.layers[i].mlp`); built lazily so that this
    module imports without torch."""

    @staticmethod
    def wrap(moe):
        import torch

        class Layer(torch.nn.Module):
            def __init__(self, mlp):
                super().__init__()
                self.mlp = mlp

        class Model(torch.nn.Module):
            def __init__(self, mlp):
                super().__init__()
                self.layers = torch.nn.ModuleList([Layer(mlp)])

            def forward(self, x):
                return self.layers[0].mlp(x)

        return Model(moe)


def build(model: str, experts: str, seed: int):
    """(the row's model on this process, its MoE module) built from a tiny config with seeded weights: identical on
    every rank. The block: MoEConfig with one shared expert, softmax top-2; the families: transformers configs."""
    import torch

    backend = backend_config(experts)
    torch.manual_seed(seed)
    if model == "block":
        from nemo_automodel.components.moe.layers import MoE

        try:
            from nemo_automodel.components.moe.config import MoEConfig
        except ImportError:  # 0.2: beside the MoE layers
            from nemo_automodel.components.moe.layers import MoEConfig

        cfg = dict(n_routed_experts=NUM_EXPERTS, n_shared_experts=1, n_activated_experts=TOP_K, n_expert_groups=0,
                   n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                   score_func="softmax", route_scale=1.0, dim=HIDDEN, inter_dim=EXPERT_INTERMEDIATE,
                   moe_inter_dim=EXPERT_INTERMEDIATE, norm_topk_prob=True, softmax_before_topk=True,
                   dtype=torch.float32)
        moe = MoE(MoEConfig(**cfg), backend)
        with torch.no_grad():  # the bare block's init_weights writes in place into leaves that require grad
            moe.init_weights(buffer_device=torch.device("cpu"))
        wrapped = Block.wrap(moe)
        return wrapped, moe
    import transformers as hf

    common = dict(hidden_size=HIDDEN, intermediate_size=2 * EXPERT_INTERMEDIATE,
                  moe_intermediate_size=EXPERT_INTERMEDIATE, num_experts_per_tok=TOP_K, num_hidden_layers=1,
                  vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False, dtype=torch.float32)
    patch: contextlib.AbstractContextManager = contextlib.nullcontext()
    if model == "qwen3_moe":
        from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM as cls

        config = hf.Qwen3MoeConfig(**common, num_experts=NUM_EXPERTS, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                   router_aux_loss_coef=0.0)
        from unittest import mock

        patch = mock.patch("torch.cuda.current_device", return_value=0)  # QWEN3_PATCH: this rank only
    elif model == "deepseek_v3":
        from nemo_automodel.components.models.deepseek_v3.model import DeepseekV3ForCausalLM as cls

        # Four expert groups of 2, two chosen per token (the grouped top-k), one shared expert.
        config = hf.DeepseekV3Config(**common, n_routed_experts=NUM_EXPERTS, n_shared_experts=1, n_group=4,
                                     topk_group=2, first_k_dense_replace=0, num_attention_heads=4,
                                     num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                     qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=1.5)
    else:
        raise ValueError(f"unknown Automodel model {model!r}")
    with patch:
        built = cls(config, backend=backend)
    built.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    from nemo_automodel.components.moe.layers import MoE

    moe = next(m for m in built.modules() if isinstance(m, MoE))
    return built, moe


def shared_experts_need_cuda() -> bool:
    """True where the installed MoE.forward runs its shared experts on a torch.cuda.Stream of their own (0.2-0.3),
    which CPU torch cannot create: rows whose block has shared experts cannot run here."""
    import inspect

    from nemo_automodel.components.moe.layers import MoE

    return "torch.cuda.Stream(" in inspect.getsource(MoE.forward)


def ep_mesh(world_size: int):
    """The one-dimensional EP mesh over every rank ("ep"), on the CPU: what `apply_ep` and the trainer's gradient
    calls take (`moe_mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))


def apply_ep(model, mesh) -> None:
    from nemo_automodel.components.moe.parallelizer import apply_ep as apply

    apply(model, mesh["ep"])


def scale_grads(model, mesh, dp_group_size: int):
    """The trainer's gradient convention, as its training step calls it (recipes/llm/train_ft.py), without the clip:
    expert gradients divided by dp / ep_shard (and the TP replication factor). Called through the module, so a
    patch of Automodel's function is what runs."""
    from nemo_automodel.components.training import utils

    fn = utils.scale_grads_and_clip_grad_norm
    return fn(None, [model], **accepted(fn, moe_mesh=mesh, ep_axis_name="ep", dp_group_size=dp_group_size,
                                        pp_enabled=False, foreach=True))


def distributed_section(ep_size: int, activation_checkpointing: str = "off", dp_replicate_size: int | None = None,
                        dtype_name: str | None = "float32") -> dict[str, Any]:
    """A recipe's `distributed:` section (fsdp2) as the rows hand it to Automodel; `dtype_name`: FSDP's mixed
    precision in that dtype throughout (the float32 rows), None: Automodel's default (bf16 params)."""
    out: dict[str, Any] = {"strategy": "fsdp2", "ep_size": ep_size,
                           "activation_checkpointing": {"off": False, "full": True}.get(activation_checkpointing,
                                                                                          "selective")}
    if dp_replicate_size:
        out["dp_replicate_size"] = dp_replicate_size
    if dtype_name is not None:
        out["mp_policy"] = {"param_dtype": dtype_name, "reduce_dtype": dtype_name, "output_dtype": dtype_name}
    return out


def parallelize(model, section: dict[str, Any], world: int, fp32: bool):
    """(mesh context, moe mesh or None): Automodel's meshes from a `distributed:` section and its own parallelizer
    applied to `model` (0.7: distributed.model_parallelizer; before: moe.parallelizer with the mesh's axis names)."""
    import torch
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config

    setup = create_distributed_setup_from_config(section, world_size=world)
    mesh = getattr(setup, "mesh_context", setup)
    try:
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    except ImportError:  # before 0.7: the MoE parallelizer with the mesh's axis names
        from nemo_automodel.components.moe.parallelizer import parallelize_model as moe_parallelize
        from torch.distributed.fsdp import MixedPrecisionPolicy

        def of_setup(name):  # 0.5-0.6 keep the policies on the DistributedSetup beside its mesh context
            return getattr(mesh, name, None) if hasattr(mesh, name) else getattr(setup, name, None)

        policy = (MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32) if fp32 else
                  getattr(of_setup("strategy_config"), "mp_policy", None))
        moe_parallelize(model, mesh.device_mesh, mesh.moe_mesh, **accepted(
            moe_parallelize, **mesh.parallelize_axis_kwargs(),
            activation_checkpointing=of_setup("activation_checkpointing") or False, mp_policy=policy))
    else:
        parallelize_model(model, mesh)
    return mesh, mesh.moe_mesh if section["ep_size"] > 1 else None


def clip_grad_norm(model, mesh, max_norm: float) -> float:
    """Automodel's own sharding-aware clip (training.utils.clip_grad_norm) with the EP mesh; the norm it clipped by."""
    from nemo_automodel.components.training import utils

    fn = utils.clip_grad_norm
    return float(fn(max_norm, [model], **accepted(fn, moe_mesh=mesh, ep_axis_name="ep", foreach=True)))


# ------------------------------------------------------------------ the rows of a user's recipe / config.json

MODEL_CLASSES = {"qwen3_moe": ("nemo_automodel.components.models.qwen3_moe.model", "Qwen3MoeForCausalLM"),
                 "deepseek_v3": ("nemo_automodel.components.models.deepseek_v3.model", "DeepseekV3ForCausalLM")}
"""The Automodel class NeMoAutoModelForCausalLM builds for each model_type the user rows take."""
USER_VOCAB = 256
"""A user row's vocabulary (hf_config's shrink says 16): each token id's embedding is much of a router input, and
with 128-256 experts 16 distinct inputs leave experts without tokens (measured: 46 of Qwen3's 128 at W = 2)."""
USER_EXTRA = {"qwen3_moe": {"vocab_size": USER_VOCAB},
              "deepseek_v3": {"num_key_value_heads": 2, "vocab_size": USER_VOCAB}}
"""What a user row sets beside libraries/hf_config.py's shrink of the family (the sizes its --hf-config notes
name): DeepSeek-V3's MLA takes as many key-value heads as heads; the vocabulary USER_VOCAB."""
MOE_SIZES = ("dim", "inter_dim", "moe_inter_dim", "shared_expert_inter_dim", "moe_latent_size")
MOE_DTYPES = ("dtype", "gate_dtype")


def moe_fields() -> set[str]:
    """The installed MoEConfig's fields (what `model.moe_overrides` may set)."""
    try:
        from nemo_automodel.components.moe.config import MoEConfig
    except ImportError:  # 0.2: beside the MoE layers
        from nemo_automodel.components.moe.layers import MoEConfig
    return {f.name for f in dataclasses.fields(MoEConfig)}


def model_class(family: str):
    import importlib

    module, name = MODEL_CLASSES[family]
    return getattr(importlib.import_module(module), name)


def user_config(family: str, routing: dict[str, Any], dtype, *, q_lora_rank: int | None = None):
    """The family's transformers config, small: libraries/hf_config.py's shrink and fixed keys of the family (the
    sizes the --hf-config notes name) and the user's routing keys (as the file has them); every other key takes the
    class default (they position and normalise, they do not route)."""
    from moebench.libraries.hf_config import FAMILIES, build_config

    family_spec = FAMILIES[family]
    kwargs = {**{k: v for k, v in family_spec.shrink.items() if v is not None}, **family_spec.fixed,
              **USER_EXTRA[family], "tie_word_embeddings": False, **routing, "dtype": str(dtype).replace("torch.", "")}
    if family == "deepseek_v3":
        kwargs["q_lora_rank"] = q_lora_rank
    return build_config(family, kwargs)


def backend_of(fields: dict[str, Any]):
    """Automodel's own BackendConfig of the CPU fields and the user's (only those the installed release has): its
    __post_init__ resolves what it resolves (te / gmm experts with the torch dispatcher -> torch_mm)."""
    import logging

    have = backend_fields()
    wanted = dict(attn="sdpa", linear="torch", rope_fusion=False, enable_hf_state_dict_adapter=False,
                  **{k: v for k, v in fields.items() if v is not None})
    if "experts" not in have:  # 0.2 picks DeepEP by this flag
        wanted["enable_deepep"] = False
    level = logging.getLogger("nemo_automodel").level
    logging.getLogger("nemo_automodel").setLevel(logging.ERROR)  # its te -> torch_mm line is the row's note
    try:
        return _backend_class()(**{k: v for k, v in wanted.items() if k in have})
    finally:
        logging.getLogger("nemo_automodel").setLevel(level)


def build_user(family: str, routing: dict[str, Any], moe_overrides: dict[str, Any], backend: dict[str, Any],
               seed: int, dtype=None, *, q_lora_rank: int | None = None):
    """(model, its MoE module): Automodel's class for `family` from the small config with the user's routing keys,
    `moe_overrides` onto the MoEConfig the class maps from the config (as NeMoAutoModelForCausalLM hands them), the
    backend; seeded weights in `dtype` (float32 by default), identical on every rank."""
    from unittest import mock

    import torch

    dtype = dtype or torch.float32
    torch.manual_seed(seed)
    config = user_config(family, routing, dtype, q_lora_rank=q_lora_rank)
    with mock.patch("torch.cuda.current_device", return_value=0):  # QWEN3_PATCH (deepseek_v3 never asks)
        built = model_class(family)(config, backend=backend_of(backend),
                                    **({"moe_overrides": dict(moe_overrides)} if moe_overrides else {}))
    built.initialize_weights(buffer_device=torch.device("cpu"), dtype=dtype)
    from nemo_automodel.components.moe.layers import MoE

    moe = next(m for m in built.modules() if isinstance(m, MoE))
    with torch.no_grad():  # every expert's router row at one norm: no expert favoured by the draw (routes_of asserts)
        weight = moe.gate.weight
        weight.copy_(torch.nn.functional.normalize(weight.float(), dim=-1).to(weight.dtype))
    return built, moe


def moe_record(moe_config) -> dict[str, Any]:
    """An MoEConfig's fields as JSON values, sizes and dtypes left out (the rows shrink them)."""
    out = {}
    for f in dataclasses.fields(moe_config):
        if f.name in MOE_SIZES or f.name in MOE_DTYPES:
            continue
        value = getattr(moe_config, f.name)
        out[f.name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    return out


def resolved_moe(family: str, routing: dict[str, Any], moe_overrides: dict[str, Any]) -> tuple[dict, bool, bool]:
    """(the MoEConfig Automodel's class builds for this config and these overrides, as JSON; whether the class
    updates its gate bias (`update_moe_gate_bias`, which the trainer calls after each step); whether it declares
    tensor parallelism): read off the class, built small on this process."""
    import torch

    model, moe = build_user(family, routing, moe_overrides, {"experts": "torch"}, 0, torch.float32)
    caps = getattr(type(model), "ModelCapabilities", None)
    return (moe_record(model.model.moe_config), hasattr(model, "update_moe_gate_bias"),
            bool(getattr(caps, "supports_tp", False)) if caps is not None else False)
