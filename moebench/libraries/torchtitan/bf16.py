"""A torchtitan row, on every rank: its MoE module in bf16, parallelized by torchtitan over the row's layout, one
forward and backward of the global batch, judged by the noise model (moebench.parity.noise).

torchtitan computes its experts in bf16 whatever the parameters' dtype (`GroupedExperts` casts before
`torch._grouped_mm`), so the rows are bf16 on both sides: the parallel module and the same module on one process
(deep-copied before parallelizing: the same weights), each in bf16. The truth is the same mathematics in float32,
written here from torchtitan's definitions (router scores, grouped top-k, route norm and scale, SwiGLU experts,
scores applied to the experts' outputs, or to their inputs in 0.2, the shared expert). Each group (the output, the
router's gradient, the experts', the shared expert's, the input gradient) must be at most BF16_NOISE_RATIO x as far
from float32 as the one-process bf16 run is. The module is parallelized as torchtitan's trainer does it (0.3:
`trainer_path`, its model's parallelize function with fully_shard, gradient divide factor 1): each rank's loss is the
sum over its tokens / the global token count, FSDP sums the gradients over the data-parallel ranks, and the whole
gradients are read through its DTensors. 0.2's rows emulate that sum (their settings declare it).
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

from moebench.libraries.spec import Row
from moebench.libraries.torchtitan import api, trainer
from moebench.parity import noise
from moebench.parity.compare import assertion
from moebench.parity.diagnosis import (
    BF16_NOISE,
    EXPERTS,
    GRAD_LEFT_PARTIAL,
    INPUT_GRAD,
    OUTPUT,
    REPLICATED,
    ROUTER,
    UNIFORM_SCALE,
    make,
)

REFERENCE_AGREES = 0.02
"""The float32 reference must be within 2 % (relative L2) of torchtitan's own one-process module with float32
parameters (its experts still compute in bf16, its router in float32, so its routes are the reference's): ~0.5 %
here; a reference that is not torchtitan's mathematics misses by tens of percent."""
DP_AXES = {"dp_shard", "dp_replicate", "fsdp", "efsdp"}
"""torchtitan's data-parallel mesh axes (a gradient that is a DTensor over one holds the data-parallel sum)."""
GROUP_OF = {"gate": ROUTER, "w1": EXPERTS, "w2": EXPERTS, "w3": EXPERTS}
WORDS = {ROUTER: "router", EXPERTS: "expert", REPLICATED: "shared-expert"}
PARTIAL_WHERE = ("torchtitan: the routed experts' local_map input-gradient placements (Partial on tp) dropped, "
                 "pytorch/torchtitan#4054")


def reference(p: dict[str, Any], x, spec: api.ModelSpec, score_before: bool, bias=None, counts=None):
    """torchtitan's MoE in float32 on one process: x [T, D] -> [T, D]. `bias`: the load-balancing expert bias (it
    chooses the experts, never weighs them); `counts`, a tensor of the experts' size: each expert's routed tokens
    are added to it."""
    import torch
    import torch.nn.functional as F

    logits = x @ p["gate"].T
    scores = torch.sigmoid(logits) if spec.score_func == "sigmoid" else F.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias
    if spec.groups:  # node-limited routing: keep the groups whose two best experts score highest
        grouped = choice.unflatten(-1, (spec.groups, spec.num_experts // spec.groups))
        kept = grouped.topk(2, dim=-1).values.sum(-1).topk(spec.limited_groups, dim=-1).indices
        dropped = torch.ones(grouped.shape[:-1], dtype=torch.bool).scatter(-1, kept, False)
        choice = grouped.masked_fill(dropped[..., None], float("-inf")).flatten(-2)
    experts = choice.topk(spec.top_k, dim=-1).indices
    if counts is not None:
        counts += torch.bincount(experts.reshape(-1), minlength=spec.num_experts).to(counts.dtype)
    top = scores.gather(-1, experts)
    if spec.route_norm:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    top = top * spec.route_scale
    out = torch.zeros_like(x)
    for k in range(spec.top_k):
        e, s = experts[:, k], top[:, k:k + 1]
        xin = x * s if score_before else x
        h = F.silu(torch.einsum("td,tfd->tf", xin, p["w1"][e])) * torch.einsum("td,tfd->tf", xin, p["w3"][e])
        y = torch.einsum("tf,tdf->td", h, p["w2"][e])
        out = out + (y if score_before else y * s)
    if spec.shared:
        out = out + (F.silu(x @ p["shared_w1"].T) * (x @ p["shared_w3"].T)) @ p["shared_w2"].T
    return out


def _batch(seed: int, dp: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (dp * api.SEQS_PER_DP_RANK, api.SEQ_LEN, api.HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, quiet (below)."""
    with quiet():
        return _run(ctx, row, opts)


@contextlib.contextmanager
def quiet():
    """A torchtitan row's known console noise off, in its rank: torchtitan's CPU-autocast warning (its router asks for
    float32 autocast, which CPU autocast does not do: the gate runs in the parameters' dtype on both sides), DTensor's
    hint (at WARNING) when it redistributes over two mesh axes one after the other (full_dtensor, FSDP's gathers), its
    from_local hint, torch.distributed's deprecations, and FSDP's warning that a module returned a view (no row writes
    to an output in place)."""
    import logging
    import warnings

    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="In CPU autocast")
            warnings.filterwarnings("ignore", message=".*torch.distributed.*deprecated")
            warnings.filterwarnings("ignore", message="To construct DTensor from torch.Tensor")
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            yield
    finally:
        redistribute.setLevel(level)


def _run(ctx, row: Row, opts) -> list:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moebench.parity.layout import ExpertLayout

    gen = setup_rank(row)
    r, w = ctx.rank, ctx.world_size
    spec = api.spec_of(row)
    dp_n, tp_n, ep_n, sp = api.degrees(row)
    torch.manual_seed(opts.seed)
    moe = api.build(gen, spec, enable_ep=ep_n > 1, enable_sp=sp)
    roles = {role: name for role, name in api.names(gen).items() if role.startswith(("gate", "w")) or spec.shared}
    params32 = dict(moe.named_parameters())
    truth_params = {role: params32[name].detach().clone().requires_grad_(True) for role, name in roles.items()}
    with torch.no_grad():  # torchtitan's own module on one process with float32 parameters: the reference's check
        y_fp32_params = moe(_batch(opts.seed, 1)[0]).float()
    base = copy.deepcopy(moe).to(torch.bfloat16)  # the same module on this process alone
    moe = moe.to(torch.bfloat16)
    context, tp, enter, dims, call, fsdp = parallelize_row(gen, moe, row, w, (dp_n, tp_n, ep_n, sp))
    dp = w // tp
    d, t = divmod(r, tp)  # the mesh is [dp_shard, tp], row-major
    dp_group, tp_group, efsdp_group = layout_groups(w, tp, ep_n, r)

    x_all, t_all = _batch(opts.seed, dp)
    tokens = x_all.shape[0] * x_all.shape[1]
    mine = my_tokens(d, t, tp, sp)
    replicas = 1 if sp else tp  # ranks holding the same tokens (TP without SP)

    xt = x_all.reshape(tokens, -1).clone().requires_grad_(True)
    y_truth = reference(truth_params, xt, spec, api.score_before_experts(gen))
    ((y_truth * t_all.reshape(tokens, -1)).sum() / tokens).backward()
    y_truth, gx_truth = y_truth.detach().reshape(x_all.shape), xt.grad.reshape(x_all.shape)

    def forward_backward(module, x, targets, enter=lambda x: x):
        x = x.detach().to(torch.bfloat16).clone().requires_grad_(True)
        y = module(enter(x))
        y = y.to_local() if isinstance(y, DTensor) else y
        ((y.float() * targets).sum() / tokens).backward()
        return y.detach().float(), x.grad.float()

    y_base, gx_base = forward_backward(base, x_all, t_all)
    with context():
        y_run, gx_run = forward_backward(call, x_all[mine], t_all[mine], enter)

    out, missing = [], []
    base_params, run_params = dict(base.named_parameters()), dict(moe.named_parameters())
    run_sums = {g: torch.zeros(3, dtype=torch.float64) for g in (ROUTER, EXPERTS, REPLICATED)}
    base_sums = {g: torch.zeros(3, dtype=torch.float64) for g in run_sums}
    partial_sums = {g: torch.zeros(3, dtype=torch.float64) for g in run_sums}
    for role, name in roles.items():
        group = GROUP_OF.get(role, REPLICATED)
        p, truth = run_params[name], truth_params[role].grad
        base_sums[group] += noise.sums([(base_params[name].grad, truth)])
        if group == EXPERTS:
            missing += _experts_held(name, api.as_dtensor(moe, name, p, dims), base_params[name], ExpertLayout,
                                     spec.num_experts, fsdp, ep_n)
        grad = api.as_dtensor(moe, name, p.grad, dims)
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        if grad is None:
            missing.append(f"{name} (no gradient)")
            grad = torch.zeros_like(truth)
        # without torchtitan's FSDP (0.2), what it would sum: the dense parameters over the data-parallel ranks, the
        # experts over the expert-data-parallel ones (efsdp); a spmd_types gradient is this rank's plain local share
        reduce_over = (efsdp_group if ep_n > 1 else dp_group) if group == EXPERTS else dp_group
        if not fsdp and reduce_over is not None and not covers_dp(p.grad):
            grad = grad.float().clone()
            dist.all_reduce(grad, group=reduce_over)
        run_sums[group] += noise.sums([(grad, truth)], 1 / w)
        if group != EXPERTS and tp_group is not None:  # what the TP ranks' gradients sum to: a Partial left behind
            summed = grad.float().clone()
            dist.all_reduce(summed, group=tp_group)
            partial_sums[group] += noise.sums([(summed, truth)], 1 / w)
    io = torch.stack([noise.sums([(y_run, y_truth[mine])], 1 / replicas),
                      noise.sums([(gx_run, gx_truth[mine])], 1 / replicas)])
    for s in (io, *run_sums.values(), *partial_sums.values()):
        dist.all_reduce(s)
    base_y = noise.sums([(y_base, y_truth)])
    check_x = _batch(opts.seed, 1)[0]
    with torch.no_grad():
        y_check = reference({k: v.detach() for k, v in truth_params.items()}, check_x.reshape(-1, api.HIDDEN), spec,
                            api.score_before_experts(gen)).reshape(check_x.shape)
    agrees = noise.distance(noise.sums([(y_fp32_params, y_check)]))
    out.append(assertion(f"the float32 reference is torchtitan's mathematics: its one-process module with float32 "
                         f"parameters is {agrees:.3g} from it (<= {REFERENCE_AGREES:g})", agrees <= REFERENCE_AGREES,
                         rank=r, group=OUTPUT))
    out.append(assertion("every parameter has a gradient and every local expert is one of the reference's",
                         not missing, rank=r, group=EXPERTS, note=f"missing: {', '.join(missing)}" if missing else ""))
    out.append(noise.judge("step 1", "output", io[0], base_y, rank=r, group=OUTPUT))
    for group in run_sums:
        if base_sums[group][2] == 0:  # no shared expert in this model
            continue
        judged = noise.judge("step 1", f"{WORDS[group]} gradient", run_sums[group], base_sums[group], rank=r,
                             group=group)
        if not judged.passed:
            judged.diagnosis = _diagnosis(group, judged, run_sums, base_sums, partial_sums[group], tp, w)
        out.append(judged)
    out.append(noise.judge("step 1", "input grad", io[1], noise.sums([(gx_base, gx_truth)]), rank=r, group=INPUT_GRAD))
    return out


def parallelize_row(gen: str, moe, row, w: int, degrees: tuple):
    """trainer_path for a bf16 or train row: its layout, its model's parallelize function."""
    return trainer_path(gen, moe, row.backend, row.ep_mode, w, degrees, parallelize_fn(row),
                        reshard_after_forward=getattr(row.settings, "reshard_after_forward", "default"))


def trainer_path(gen: str, moe, backend: str, layout: str, w: int, degrees: tuple | None, fn_path: str,
                 param_dtype: str = "bfloat16", reshard_after_forward: str = "default"):
    """(context, TP degree, input entry, ParallelDims, the model to call, whether torchtitan's FSDP reduces the
    gradients): 0.3 through its trainer's parallelize function with fully_shard (trainer.trainer_parallelize; a torch
    whose fully_shard refuses the backend's parameters: the row is refused with FSDP's own words); 0.2 through
    api.parallelize, its FSDP not applied (the rows' `dense_grads` say so, and emulate its reduction)."""
    if gen != "common":
        context, tp, enter, dims = api.parallelize(gen, moe, backend, layout, w, degrees)
        return context, tp, enter, dims, api.one_block_model(moe), False
    try:
        context, tp, enter, dims, shell = trainer.trainer_parallelize(moe, backend, layout, w, degrees, fn_path,
                                                                  reshard_after_forward, param_dtype)
    except ValueError as exc:
        why = trainer.fsdp_refusal(backend)
        if why is None or "DTensors on the full SPMD mesh" not in str(exc):
            raise
        trainer.refuse(why)
    return context, tp, enter, dims, shell, True


def parallelize_fn(row) -> str:
    """The "module:function" of the parallelize function torchtitan's trainer calls for the row's model."""
    return getattr(row.settings, "parallelize_fn", "") or trainer.PARALLELIZE_FN[row.model]


def setup_rank(row) -> str:
    """Every torchtitan row's first step in its rank (bf16, train and resume rows): its modules imported, pointed at
    the CPU, 0.2's CPU gaps bridged (api.V02_PATCH), spmd_types' uneven all-to-all padded for gloo where the row
    records it (exchange.PATCH); returns the generation."""
    from moebench.libraries.torchtitan.exchange import bridge

    gen = api.load()
    api.point_at_cpu()
    if gen == "moe":
        api.bridge_v02_cpu_gaps()
    if row.settings.patch.startswith("spmd_types"):
        bridge()
    return gen


def covers_dp(grad) -> bool:
    """True for a gradient that is a DTensor Partial over a data-parallel axis (full_dtensor's dense gradients): its
    full_tensor() is the data-parallel sum. A gradient Replicate over one (full_dtensor's experts over efsdp) holds
    this rank's share only, as a plain gradient does."""
    from torch.distributed.tensor import DTensor, Partial

    return isinstance(grad, DTensor) and any(
        isinstance(placement, Partial) and axis in DP_AXES
        for placement, axis in zip(grad.placements, grad.device_mesh.mesh_dim_names or ()))


def layout_groups(w: int, tp: int, ep: int, r: int):
    """(data-parallel group, TP group, expert-data-parallel group) of rank r, each None where its degree is 1: the
    dense mesh is [dp_shard, tp] and the sparse one [efsdp, ep], both row-major over the same ranks."""
    dp = w // tp
    d, t = divmod(r, tp)
    dp_group = _groups([[dd * tp + tt for dd in range(dp)] for tt in range(tp)], t) if dp > 1 else None
    tp_group = _groups([[dd * tp + tt for tt in range(tp)] for dd in range(dp)], d) if tp > 1 else None
    efsdp = w // ep if ep > 1 else 1
    efsdp_group = (_groups([[f * ep + e for f in range(efsdp)] for e in range(ep)], r % ep)
                   if ep > 1 and efsdp > 1 else None)
    return dp_group, tp_group, efsdp_group


def my_tokens(d: int, t: int, tp: int, sp: bool):
    """This rank's part of the global batch [sequences, positions]: its data-parallel rank's sequences, and under
    sequence parallelism its TP rank's slice of their positions."""
    piece = slice(t * api.SEQ_LEN // tp, (t + 1) * api.SEQ_LEN // tp) if sp else slice(None)
    return (slice(d * api.SEQS_PER_DP_RANK, (d + 1) * api.SEQS_PER_DP_RANK), piece)


def _groups(member_lists: list[list[int]], mine: int):
    """Every rank creates every group (a collective), and keeps the `mine`-th."""
    import torch.distributed as dist

    made = [dist.new_group(ranks) for ranks in member_lists]
    return made[mine]


def _experts_held(name: str, p, base_p, layout_cls, experts: int = api.NUM_EXPERTS, fsdp: bool = False,
                  ep: int = 1) -> list[str]:
    """What is wrong with the experts this rank holds: under EP each local slot must be the global expert the layout
    names (contiguous over the ep mesh), with the one-process module's bf16 weights; under FSDP (its shard over
    EP's), the parameter's global view must be the one-process module's, expert by expert, and with EP asked
    (`ep` > 1) its experts sharded over an "ep" mesh axis."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    if fsdp and isinstance(p, DTensor):  # FSDP's shard over EP's: the global view, expert by expert
        whole = p.full_tensor().detach()
        wrong = [f"{name}[expert {e}]" for e in range(whole.shape[0]) if not torch.equal(whole[e], base_p.detach()[e])]
        names = list(p.device_mesh.mesh_dim_names or ())
        if ep > 1 and ("ep" not in names or type(p.placements[names.index("ep")]) is not Shard
                       or p.placements[names.index("ep")].dim != 0):  # FSDP alone would be right, but not EP
            wrong.append(f"{name} (not sharded over the experts on an ep mesh axis: {names} {list(p.placements)})")
        return wrong
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 0] if isinstance(
        p, DTensor) else []
    if not dims:
        return []
    mesh, dim = p.device_mesh, dims[0]  # the expert dim is sharded over one mesh axis: "ep"
    layout = layout_cls(experts, mesh.size(dim))
    held = p.to_local().detach()
    ep_rank = mesh.get_local_rank(dim)
    return [f"{name}[local {i}]" for i in range(held.shape[0])
            if not torch.equal(held[i], base_p.detach()[layout.global_expert(ep_rank, i)])]


def _diagnosis(group: str, judged, run_sums: dict, base_sums: dict, partial, tp: int, w: int) -> dict[str, Any]:
    """A group outside the noise: one TP rank's share (the sum over the TP ranks is right), else scaled by one
    factor (x W: summed instead of averaged), else the distance with the group's fitted factor."""
    ratio_limit = noise.BF16_NOISE_RATIO * noise.distance(base_sums[group])
    if tp > 1 and noise.distance(partial) <= ratio_limit:
        return make(GRAD_LEFT_PARTIAL, f"bf16: the {WORDS[group]} gradient is one TP rank's share: summed over the "
                    f"{tp} TP ranks it is right within the noise ({noise.distance(partial):.3g} from float32); "
                    f"a gradient placement dropped ({PARTIAL_WHERE})", tp=tp, group=WORDS[group])
    found = noise.fit(run_sums[group])
    if found is not None and found[1] <= noise.GROUP_FIT_RTOL:
        c = found[0]
        n = round(c) if round(c) >= 2 and abs(c - round(c)) <= noise.GROUP_FIT_RTOL * c else None
        why = f": summed instead of averaged over {w} ranks (the world size)" if n == w else ""
        return make(UNIFORM_SCALE, f"bf16: {WORDS[group]} gradients scaled by {c:.3g}{why}", scale=c, integer=n)
    fitted = f"x{found[0]:.3g} (residual {100 * found[1]:.0f} %)" if found else "no reference"
    baseline = noise.distance(base_sums[group])
    return make(BF16_NOISE, f"{judged.name.split(': ', 1)[1]} ({judged.note}); fitted: {fitted}",
                fit=list(found) if found else None, distance=noise.distance(run_sums[group]),
                baseline=None if math.isinf(baseline) else baseline)
