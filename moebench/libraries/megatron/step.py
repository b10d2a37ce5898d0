"""What a Megatron row builds and runs on each rank, through megatron-core's own objects, as a training script does.

`initialize_model_parallel` over gloo with the row's TP / EP / ETP; a `TransformerConfig`; the MoE module of Megatron's
GPT layer spec without Transformer Engine (`get_gpt_layer_local_spec(...).submodules.mlp`: TopKRouter, the row's token
dispatcher, SequentialMLP or GroupedMLP, SharedExpertMLP) inside `Block` (a MegatronModule holding that one layer);
its `DistributedDataParallel`, `finalize_model_grads` as the config's finalize function, `get_megatron_optimizer` (Adam
with clipping); each step `get_forward_backward_func()` then `optimizer.step()` (megatron/training's train_step).

Weights are drawn per global unit from the seed (the router, each expert by its GLOBAL index, the shared expert), the
full tensor on every rank, and each rank copies the slice it holds (`pieces`): so every rank's model and the one-
process reference start equal. The data: the global batch from (seed, step), [seq, DP x micro-batch, hidden]
(Megatron is sequence-first); DP rank d holds its micro-batch, TP rank t (sequence parallel) its part of the sequence.
A rank's loss: the sum over its tokens of <output, target>, its DP rank's token count as `num_tokens` (the TP
ranks' losses sum to their DP rank's, as in a GPT model).

Imports only the standard library, torch and megatron-core: `--repro` scripts paste it whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MODULES = ("megatron.core.parallel_state", "megatron.core.transformer.transformer_config",
           "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.moe.moe_layer",
           "megatron.core.transformer.moe.experts", "megatron.core.transformer.moe.token_dispatcher",
           "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.pipeline_parallel")
"""What a row imports (standins.import_megatron): once in the parent before the ranks fork (loaded.py)."""
NUM_EXPERTS = 8
HIDDEN = 16
FFN = 16
"""Each routed expert's intermediate size (SwiGLU: fc1 is 2 x FFN wide)."""
SHARED_FFN = 16
SEQ = 8
MICRO = 2
"""Each DP rank's micro-batch: MICRO sequences of SEQ tokens (16 tokens; 8 per TP rank at TP = 2)."""
ROUTER_STD = 1.0
"""The router's weights are drawn wide so that routes are decisive: a top-k near-tie (1e-7 apart) could flip between
two float32 summation orders and read as an error."""
WEIGHT_STD = 0.3
LR = 0.01
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-4
"""Adam's eps. At Megatron's default 1e-8 a gradient element near zero moves its weight by up to lr on a float32
rounding (Adam's update lr g / (|g| + eps) is lr / eps = 1e6 times as sensitive there), so step 2's gradients, taken at
those weights, differed by 1e-5 of their size between two summation orders (seed 3: a false alarm at STRICT);
1e-4 keeps that sensitivity at lr / eps = 100. Both sides use it: the optimizer's config, not a tolerance."""
WEIGHT_DECAY = 0.01
CLIP = 0.05
"""Megatron's clip_grad: below every row's step-1 gradient norm (0.1-1 here), so the clip binds and its norm counts."""


def layout(settings: dict, world_size: int) -> dict[str, int]:
    """The row's parallel sizes: tp, etp, ep from the settings, dp (dense) and edp (expert data parallel) derived."""
    tp, etp, ep = settings["tp"], settings["etp"], settings["ep"]
    return {"tp": tp, "etp": etp, "ep": ep, "dp": world_size // tp, "edp": world_size // (etp * ep)}


# ------------------------------------------------------------------ global units and their seeded values

def units(settings: dict) -> dict[str, tuple[int, ...]]:
    """Every global unit of the model and its shape (fp32 on one process)."""
    out = {"router": (NUM_EXPERTS, HIDDEN)}
    for e in range(NUM_EXPERTS):
        out.update({f"expert{e}.gate": (FFN, HIDDEN), f"expert{e}.up": (FFN, HIDDEN),
                    f"expert{e}.down": (HIDDEN, FFN)})
    if settings.get("shared"):
        out.update({"shared.gate": (SHARED_FFN, HIDDEN), "shared.up": (SHARED_FFN, HIDDEN),
                    "shared.down": (HIDDEN, SHARED_FFN)})
        if settings.get("shared_gate"):
            out["shared.gate_weight"] = (1, HIDDEN)
    return out


def initial_values(settings: dict, seed: int) -> dict[str, Any]:
    """Each unit drawn from (seed, its name): the same tensors on every rank and in the reference."""
    import zlib

    import torch

    values = {}
    for name, shape in units(settings).items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = ROUTER_STD if name == "router" else WEIGHT_STD
        values[name] = torch.randn(shape, generator=g) * std
    return values


def batch(settings: dict, seed: int, step: int, world_size: int):
    """(inputs, targets) of the global batch at `step`: [SEQ, DP x MICRO, HIDDEN] each."""
    import torch

    dp = layout(settings, world_size)["dp"]
    g = torch.Generator().manual_seed(seed * 7919 + 104729 * (step + 1))
    shape = (SEQ, dp * MICRO, HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def chunk(tensor, tp_rank: int, dp_rank: int, tp: int):
    """A rank's tokens of a global-batch tensor: its DP rank's sequences, its TP rank's part of the sequence."""
    s = SEQ // tp
    return tensor[tp_rank * s:(tp_rank + 1) * s, dp_rank * MICRO:(dp_rank + 1) * MICRO]


# ------------------------------------------------------------------ Megatron's model on this rank

def moe_spec(settings: dict):
    """The MoE module of the GPT layer spec without Transformer Engine (Megatron's own local spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=NUM_EXPERTS,
                                    moe_grouped_gemm=settings["experts"] == "grouped").submodules.mlp


def transformer_config(settings: dict):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = settings["precision"] == "bf16"
    kwargs = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=settings["topk"],
        moe_token_dispatcher_type=settings["dispatcher"], tensor_model_parallel_size=settings["tp"],
        expert_model_parallel_size=settings["ep"], expert_tensor_parallel_size=settings["etp"],
        sequence_parallel=settings["tp"] > 1, use_cpu_initialization=True, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        moe_grouped_gemm=settings["experts"] == "grouped", bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        moe_router_score_function=settings["score"], moe_router_pre_softmax=settings["pre_softmax"],
        moe_router_num_groups=settings.get("groups"), moe_router_group_topk=settings.get("group_topk"),
        moe_router_topk_scaling_factor=settings.get("scaling"),
        moe_router_enable_expert_bias=settings.get("expert_bias") is not None,
        moe_router_bias_update_rate=settings.get("expert_bias") or 1e-3,
        moe_expert_capacity_factor=settings.get("capacity"),
        moe_pad_expert_input_to_capacity=bool(settings.get("pad")),
        moe_aux_loss_coeff=settings.get("aux") or 0.0,
        moe_router_load_balancing_type="aux_loss" if settings.get("aux") else "none",
        moe_z_loss_coeff=settings.get("z"), calculate_per_token_loss=bool(settings.get("per_token")),
        moe_shared_expert_intermediate_size=settings.get("shared"),
        moe_shared_expert_gate=bool(settings.get("shared_gate")),
    )
    import dataclasses as dc

    known = {f.name for f in dc.fields(TransformerConfig)}
    lacking = [k for k, v in kwargs.items() if k not in known and v not in (None, False, 0, 0.0, "none")]
    if lacking:  # the adapter skips such rows (api.lacks); a direct call says what this release lacks
        raise TypeError(f"this megatron-core's TransformerConfig has no {', '.join(lacking)}")
    return TransformerConfig(**{k: v for k, v in kwargs.items() if k in known})


def build_moe(spec, config):
    """The MoE layer from the spec: a ModuleSpec through build_module (0.16), a builder called with the config (0.17+,
    where the GPT specs hold builders)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    layer.set_layer_number(1)  # what TransformerLayer does: the aux-loss tracker's layer
    return layer


def make_block(config, spec):
    """A MegatronModule holding the one MoE layer: what DDP wraps and the schedule drives (set_input_tensor,
    model_type)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class Block(MegatronModule):
        model_type = ModelType.encoder_or_decoder

        def __init__(self):
            super().__init__(config)
            self.mlp = build_moe(spec, config)

        def set_input_tensor(self, input_tensor) -> None:
            pass

        def forward(self, hidden_states):
            output, bias = self.mlp(hidden_states)
            return output

    return Block()


@dataclasses.dataclass
class Piece:
    """A slice of a global unit held by one local parameter."""

    unit: str
    index: tuple
    """Which part of the global unit (a tuple of slices)."""
    view: Any
    """local tensor -> the view of it that holds that part, in the unit's orientation."""


def pieces(name: str, param, settings: dict, ranks: dict[str, int], local_experts: list[int]) -> list[Piece]:
    """The global units (and their slices) local parameter `name` holds. Routed experts: SequentialMLP's
    `local_experts.i.linear_fc1.weight` is [gate; up] of this ETP rank's rows, `linear_fc2.weight` down's columns;
    GroupedMLP's weight1 / weight2 are the same per expert as the memory views its forward takes
    (weight1.view(E_local, H, -1)[i] = [gate; up]^T, weight2.view(E_local, -1, H)[i] = down^T). The shared expert's fc1
    / fc2 are split over the TP ranks the same way."""
    etp, tp = settings["etp"], settings["tp"]
    if name.endswith("router.weight"):
        return [Piece("router", (slice(None), slice(None)), lambda t: t)]
    if name.endswith("shared_experts.gate_weight"):
        return [Piece("shared.gate_weight", (slice(None), slice(None)), lambda t: t)]
    if ".shared_experts." in name:
        f, r = SHARED_FFN // tp, ranks["tp"]
        rows = slice(r * f, (r + 1) * f)
        if name.endswith("linear_fc1.weight"):
            return [Piece("shared.gate", (rows, slice(None)), lambda t: t[:f]),
                    Piece("shared.up", (rows, slice(None)), lambda t: t[f:])]
        return [Piece("shared.down", (slice(None), rows), lambda t: t)]
    f, r = FFN // etp, ranks["etp"]
    rows = slice(r * f, (r + 1) * f)
    if ".local_experts." in name:
        e = local_experts[int(name.split(".local_experts.")[1].split(".")[0])]
        if name.endswith("linear_fc1.weight"):
            return [Piece(f"expert{e}.gate", (rows, slice(None)), lambda t: t[:f]),
                    Piece(f"expert{e}.up", (rows, slice(None)), lambda t: t[f:])]
        return [Piece(f"expert{e}.down", (slice(None), rows), lambda t: t)]
    n = len(local_experts)
    if name.endswith("experts.weight1"):
        return [p for i, e in enumerate(local_experts) for p in (
            Piece(f"expert{e}.gate", (rows, slice(None)), lambda t, i=i: t.view(n, HIDDEN, -1)[i][:, :f].t()),
            Piece(f"expert{e}.up", (rows, slice(None)), lambda t, i=i: t.view(n, HIDDEN, -1)[i][:, f:].t()))]
    if name.endswith("experts.weight2"):
        return [Piece(f"expert{e}.down", (slice(None), rows), lambda t, i=i: t.view(n, -1, HIDDEN)[i].t())
                for i, e in enumerate(local_experts)]
    raise KeyError(f"no global unit for Megatron parameter {name}")


def slice_label(index: tuple) -> str:
    """" rows 0:8" / " cols 8:16" for a slice of a unit, "" for the whole unit (how comparisons name a piece)."""
    parts = []
    for axis, sl in zip(("rows", "cols"), index):
        if sl.start is not None or sl.stop is not None:
            parts.append(f" {axis} {sl.start or 0}:{sl.stop}")
    return "".join(parts)


def layout_pieces(settings: dict) -> list[tuple[str, tuple]]:
    """Every (unit, slice) some rank holds under the row's layout: the experts split over the ETP ranks, the shared
    expert over the TP ranks, the router and the shared expert's gate whole."""
    whole = (slice(None), slice(None))
    out = [("router", whole)]
    etp, tp = settings["etp"], settings["tp"]
    for e in range(NUM_EXPERTS):
        f = FFN // etp
        for r in range(etp):
            rows = slice(r * f, (r + 1) * f)
            out += [(f"expert{e}.gate", (rows, slice(None))), (f"expert{e}.up", (rows, slice(None))),
                    (f"expert{e}.down", (slice(None), rows))]
    if settings.get("shared"):
        f = SHARED_FFN // tp
        for t in range(tp):
            rows = slice(t * f, (t + 1) * f)
            out += [("shared.gate", (rows, slice(None))), ("shared.up", (rows, slice(None))),
                    ("shared.down", (slice(None), rows))]
        if settings.get("shared_gate"):
            out.append(("shared.gate_weight", whole))
    return out


@dataclasses.dataclass
class Rank:
    """This rank's place and its Megatron objects."""

    settings: dict
    ranks: dict[str, int]
    """tp, etp, ep, dp (dense data-parallel) and edp ranks."""
    sizes: dict[str, int]
    model: Any
    """Megatron's DistributedDataParallel around the Block."""
    optimizer: Any
    config: Any
    local_experts: list[int]
    held: dict[str, list[Piece]]
    """Local parameter name (in the Block) -> the pieces of global units it holds."""


def build(settings: dict, seed: int, world_size: int) -> Rank:
    """Megatron's model, DDP and optimizer on this rank, from its own objects (module docstring)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ps.initialize_model_parallel(tensor_model_parallel_size=settings["tp"],
                                 expert_model_parallel_size=settings["ep"],
                                 expert_tensor_parallel_size=settings["etp"])
    config = transformer_config(settings)
    block = make_block(config, moe_spec(settings))
    ranks = {"tp": ps.get_tensor_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
             "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
             "edp": ps.get_expert_data_parallel_rank()}
    local_experts = list(block.mlp.local_expert_indices)
    values = initial_values(settings, seed)
    held = {}
    with torch.no_grad():
        for name, param in block.named_parameters():
            held[name] = pieces(name, param, settings, ranks, local_experts)
            for piece in held[name]:
                piece.view(param.data).copy_(values[piece.unit][piece.index])
    bf16 = settings["precision"] == "bf16"
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=settings["distributed_optimizer"])
    model = DistributedDataParallel(config, ddp_config, block)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=ADAM_BETAS[0],
                        adam_beta2=ADAM_BETAS[1], adam_eps=ADAM_EPS, clip_grad=CLIP, bf16=bf16,
                        params_dtype=torch.bfloat16 if bf16 else torch.float32,
                        use_distributed_optimizer=settings["distributed_optimizer"]), [model])
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    return Rank(settings=settings, ranks=ranks, sizes=layout(settings, world_size), model=model, optimizer=optimizer,
                config=config, local_experts=local_experts, held=held)


@dataclasses.dataclass
class StepRecord:
    """What one training step left on this rank."""

    output: Any
    input_grad: Any
    loss: float
    """This rank's loss: the sum over its tokens of <output, target> (before the schedule's scaling)."""
    grads: dict[str, Any]
    """Local parameter name -> its gradient after finalize_model_grads (main_grad, float32)."""
    grad_norm: float | None
    params: dict[str, Any]
    """Local parameter name -> its value after optimizer.step() (float32)."""
    expert_bias: Any
    """The router's expert_bias after the step (None without one)."""
    local_tokens: int


def train_step(run: Rank, seed: int, step: int, world_size: int) -> StepRecord:
    """One step as megatron/training's train_step: zero the grad buffers, the schedule's forward-backward (its loss
    scaling, the aux-loss scale and finalize_model_grads), optimizer.step()."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    settings, sizes, ranks = run.settings, run.sizes, run.ranks
    x_all, t_all = batch(settings, seed, step, world_size)
    dtype = torch.bfloat16 if settings["precision"] == "bf16" else torch.float32
    x = chunk(x_all, ranks["tp"], ranks["dp"], sizes["tp"]).contiguous().to(dtype).requires_grad_(True)
    target = chunk(t_all, ranks["tp"], ranks["dp"], sizes["tp"]).contiguous()
    dp_tokens = SEQ * MICRO
    seen = {}

    def forward_step(data_iterator, model):
        inputs = next(data_iterator)
        output = model(inputs)
        seen["output"] = output

        def loss_func(out):
            loss = (out.float() * target).sum()
            seen["loss"] = float(loss.detach())
            return loss, torch.tensor(dp_tokens, dtype=torch.int), {"loss": loss.detach()}

        return output, loss_func

    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([x]), model=[run.model],
                                num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO, forward_only=False)
    block = run.model.module
    grads = {name: p.main_grad.detach().float().clone() for name, p in block.named_parameters()}
    update_successful, grad_norm, _ = run.optimizer.step()
    if not update_successful:
        raise RuntimeError(f"Megatron's optimizer skipped step {step + 1} (found inf or nan in the gradients)")
    router = block.mlp.router
    bias = getattr(router, "expert_bias", None)
    return StepRecord(output=seen["output"].detach().float().clone(), input_grad=x.grad.detach().float().clone(),
                      loss=seen["loss"], grads=grads, grad_norm=None if grad_norm is None else float(grad_norm),
                      params={name: p.detach().float().clone() for name, p in block.named_parameters()},
                      expert_bias=None if bias is None else bias.detach().float().clone(),
                      local_tokens=x.shape[0] * x.shape[1])


def teardown() -> None:
    """Undo initialize_model_parallel and close the process groups it opened (rows run one after another in one
    process in the tests: gloo groups left open pile up, a few dozen a row)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    opened: list = []
    for value in list(vars(ps).values()):
        for group in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD and all(
                    group is not g for g in opened):
                opened.append(group)
    ps.destroy_model_parallel()
    for group in opened:
        try:
            dist.destroy_process_group(group)
        except ValueError:  # one torch no longer knows (a group Megatron keeps under a second name, closed already)
            pass
