"""A torchtitan resume row, on every rank: its MoE (DeepSeek-V3's router: sigmoid, grouped top-k, a shared expert,
and aux-loss-free load balancing, its expert bias updated by the optimizers' step pre-hook torchtitan registers)
trained through torchtitan's own optimizers container, saved and loaded by torchtitan's own `CheckpointManager` over
DCP, as its trainer calls them (`checkpointer.save(step)`, `checkpointer.load(step)`).

1. Module A, parallelized over the save layout (EP over every rank), trains SAVE_STEPS steps (torchtitan's
   `OptimizersContainer`, Adam; `register_moe_load_balancing_hook`); every rank must hold the same expert bias
   after every step. A's state (weights, Adam's exp_avg / exp_avg_sq, the expert bias) is kept, read as whole tensors
   through the parallelization (a spmd_types state through torchtitan's `plain_tensor_to_dtensor_state_dict`).
2. `CheckpointManager.save(SAVE_STEPS)` into a folder under moebench's temporary root; A trains on: the run that
   never stopped.
3. Module B, built from another seed and parallelized over the load layout (the same, or TP without EP: DCP's
   resharding), `CheckpointManager.load(SAVE_STEPS)`. Right after the load every expert slot of every rank is
   matched against every global expert's weights and moments, and every rank's expert bias against A's
   (moebench.parity.restore): a slot holding another expert's state is named slot by slot.
4. Same layout: B trains on CONTINUE_STEPS steps on the same batches, bit for bit with A at every step.
Gradient convention as the bf16 rows (bf16.py): a rank's loss is the sum over its tokens / the global token count;
0.3's sides are parallelized through its trainer's parallelize function (fully_shard, FSDP_PARAM_DTYPE), whose FSDP
sums the gradients; 0.2's sum them here (its FSDP, emulated: declared in the rows' settings).
"""

from __future__ import annotations

from typing import Any

from moebench.libraries.spec import Row
from moebench.libraries.torchtitan import api, trainer

SAVE_STEPS = 2
CONTINUE_STEPS = 2
LR = 1e-2
LOAD_BALANCE_COEFF = 1e-2
"""Large enough that the bias moves visibly in two steps (the sign update adds +-coeff per step)."""
FRESH_SEED_OFFSET = 7919
BASELINE_AGREES = 0.1
"""torchtitan's module on one process (its grouped experts in bf16) must be within this relative L2 distance of the
float32 mathematics, per gradient group, or the noise model's baseline shares what is wrong: measured 0.0027-0.018
(seeds 0-4, W = 2 and 4); a gradient missing, detached or halved is 0.5-1 away."""
FSDP_PARAM_DTYPE = "float32"
"""training.mixed_precision_param of the resume rows' FSDP (0.3): float32 compute, as a launch may set it."""
BIAS = "expert_bias_E"
"""The expert bias of 0.3's MoE (0.2's: `expert_bias`)."""


def bias_name(gen: str) -> str:
    return BIAS if gen == "common" else "expert_bias"


def is_expert(gen: str, name: str) -> bool:
    """Whether `name` is a routed expert's parameter (stacked over the experts along dim 0)."""
    return name in {v for role, v in api.names(gen).items() if role in ("w1", "w2", "w3")}


def _model(moe):
    """torchtitan's model shape around the MoE: what its load balancing hook walks (api.one_block_model)."""
    return api.one_block_model(moe)


def _make(gen: str, row: Row, layout: str, seed: int, world: int, ep: int = 0):
    """(model, moe, optimizers, forward context, input entry, ParallelDims) of one side. 0.3: its Module protocol,
    `OptimizersContainer` and `register_moe_load_balancing_hook`; 0.2: its EP step (api.parallelize), or no
    parallelism at all (layout "none": the whole module on every rank), `build_optimizers_with_moe_load_balancing`.
    `ep` (0.3, layout "ep"): an EP degree below the world size, the experts then kept over efsdp = W / ep ranks.
    Two sides of one layout share its ParallelDims (api.parallel_dims: one per layout and process)."""
    import contextlib

    import torch

    torch.manual_seed(seed)
    moe = api.build(gen, row.model, enable_ep=layout not in ("tp", "none"), enable_sp=layout == "ep+tp",
                    load_balance_coeff=LOAD_BALANCE_COEFF)
    if layout == "none":
        context, enter, dims, model = contextlib.nullcontext, (lambda x: x), None, _model(moe)
    else:
        from moebench.libraries.torchtitan.bf16 import trainer_path

        degrees = (world, 1, ep, False) if ep and ep != world else None  # (dp_shard, tp, ep, sequence parallel)
        # 0.3: its trainer's FSDP in float32 (training.mixed_precision_param): the restore and the continuation are
        # compared bit for bit, the uninterrupted steps against one process in float32
        fn = trainer.PARALLELIZE_FN[row.model]
        context, _, enter, dims, model, _ = trainer_path(gen, moe, row.backend, layout, world, degrees, fn,
                                                         param_dtype=FSDP_PARAM_DTYPE)
    if gen == "moe":
        from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
        from torchtitan.config.job_config import Optimizer
        from torchtitan.distributed import ParallelDims

        hook_dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
        hook_dims.build_mesh()  # the hook sums the token counts over its "loss" mesh (the data-parallel ranks)
        optimizers = build_optimizers_with_moe_load_balancing(
            [model], Optimizer(name="Adam", lr=LR, implementation="for-loop"), hook_dims)
        return model, moe, optimizers, context, enter, dims
    from torchtitan.components.optimizer.optimizer import (
        OptimizersContainer,
        ParamGroupConfig,
        register_moe_load_balancing_hook,
    )

    config = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": LR})], implementation="for-loop")
    optimizers = OptimizersContainer(config, model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], dims)
    return model, moe, optimizers, context, enter, dims


def _checkpointer(gen: str, folder: str, model, optimizers):
    """torchtitan's own CheckpointManager as its trainer builds it (0.3: its Config; 0.2: job_config's Checkpoint)."""
    from torchtitan.components.checkpoint import CheckpointManager

    if gen == "moe":
        from torchtitan.config.job_config import Checkpoint

        config = Checkpoint(enable=True, folder="checkpoint", interval=1,
                            exclude_from_loading=["dataloader", "lr_scheduler"])
        return CheckpointManager(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
                                 states={}, checkpoint_config=config, sd_adapter=None, base_folder=folder,
                                 ft_manager=None)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, initial_load_model_only=False,
                                      exclude_from_loading=["dataloader", "lr_scheduler"])
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
                             states={}, sd_adapter=None, base_folder=folder)


def _batch(seed: int, step: int, world: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    shape = (world * api.SEQS_PER_DP_RANK, api.SEQ_LEN, api.HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _train(side, step: int, seed: int, rank: int, world: int, grads: dict | None = None) -> None:
    """One step of one side on this rank's sequences (EP: each rank its own); `grads` (a dict) gets every
    parameter's whole gradient before the optimizers' step (a collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moebench.libraries.torchtitan.bf16 import covers_dp, layout_groups

    model, moe, optimizers, context, enter, dims = side
    gen = api.generation()
    x_all, t_all = _batch(seed, step, world)
    mine = slice(rank * api.SEQS_PER_DP_RANK, (rank + 1) * api.SEQS_PER_DP_RANK)
    tokens = x_all.shape[0] * x_all.shape[1]
    with context():
        y = model(enter(x_all[mine].clone()))  # the root's forward: FSDP's hooks gather and reduce (0.3)
        y = y.to_local() if isinstance(y, DTensor) else y
        ((y.float() * t_all[mine]).sum() / tokens).backward()
    ep = dims.ep if dims is not None else world
    efsdp = layout_groups(world, 1, ep, rank)[2] if ep < world else None  # the ranks holding the same experts
    for name, p in moe.named_parameters():  # without torchtitan's FSDP (0.2): what it sums, emulated
        if p.grad is None or covers_dp(p.grad) or fsdp_applied(model):
            continue
        if not is_expert(gen, name):
            dist.all_reduce(p.grad)
        elif efsdp is not None:
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=efsdp)
    if grads is not None:
        grads.update({name: _whole(moe, name, p.grad, side[5]) for name, p in moe.named_parameters()
                      if p.grad is not None})
    optimizers.step()
    optimizers.zero_grad()


def fsdp_applied(model) -> bool:
    """Whether torchtitan's trainer path wrapped `model` in FSDP (its gradients reduced by FSDP's hooks)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _whole(moe, name: str, t, dims):
    from torch.distributed.tensor import DTensor

    t = api.as_dtensor(moe, name, t, dims)
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(side) -> dict[str, dict[str, Any]]:
    """{"weights": {name: whole tensor}, "exp_avg": ..., "exp_avg_sq": ..., "bias": {BIAS: whole tensor}}."""
    _, moe, optimizers, _, _, dims = side
    out: dict[str, dict[str, Any]] = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}, "bias": {}}
    for name, p in moe.named_parameters():
        out["weights"][name] = _whole(moe, name, p, dims)
        state = next((o.state[p] for o in optimizers.optimizers if p in o.state), {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[key][name] = _whole(moe, name, state[key], dims)
    name = bias_name(api.generation())
    out["bias"][BIAS] = _whole(moe, name, getattr(moe, name), dims)
    return out


def _findings(side, saved: dict, fresh: dict, rank: int, world: int, layout: str) -> list:
    """(comparison name, Finding) for every slot this rank holds: its weights and moments matched against every
    global expert's at the save, the dense parameters' and the expert bias against their own."""
    from moebench.parity import restore
    from moebench.parity.layout import ExpertLayout

    quantities = {"weights": restore.WEIGHTS, "exp_avg": restore.EXP_AVG, "exp_avg_sq": restore.EXP_AVG_SQ}
    now = _state(side)
    out = []
    whole = layout in ("tp", "none")  # every rank holds every expert (in pieces under TP)
    held = ExpertLayout(api.NUM_EXPERTS, world).experts_of(rank) if not whole else (
        range(api.NUM_EXPERTS) if rank == 0 else [])
    gen = api.generation()
    for key, quantity in quantities.items():
        for name, got in now[key].items():
            if is_expert(gen, name):
                want = {e: saved[key][name][e] for e in range(api.NUM_EXPERTS)}
                for slot, e in enumerate(held):
                    where = restore.Slot(rank=rank, local=e if whole else slot, unit=e)
                    f = restore.identify(where, quantity, got[e], want,
                                         fresh=fresh[key][name][e] if key == "weights" else None)
                    out.append((f"after the load: {name} [expert {e}] {key}", f))
            elif name in saved[key]:
                where = restore.Slot(rank=rank, local=None, unit=name)
                out.append((f"after the load: {name} {key}", restore.identify(
                    where, quantity, got, {name: saved[key][name]},
                    fresh=fresh[key].get(name) if key == "weights" else None)))
    where = restore.Slot(rank=rank, local=None, unit=BIAS)
    out.append(("after the load: the expert bias", restore.identify(where, restore.WEIGHTS, now["bias"][BIAS],
                                                                   {BIAS: saved["bias"][BIAS]})))
    return out


def _biases_agree(side, rank: int, tag: str):
    """Every rank holds the same expert bias (its update must be the same on every rank before any save)."""
    import torch
    import torch.distributed as dist

    from moebench.parity.compare import assertion
    from moebench.parity.diagnosis import ROUTER

    _, moe, _, _, _, dims = side
    name = bias_name(api.generation())
    mine = _whole(moe, name, getattr(moe, name), dims)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, b in enumerate(every) if not torch.equal(b, every[0])]
    return assertion(f"{tag}: every rank holds the same expert bias", not differ, rank=rank, group=ROUTER,
                     note=f"ranks {differ} hold another bias than rank 0's" if differ else "")


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, quiet as the bf16 rows (bf16.quiet)."""
    from moebench.libraries.torchtitan.bf16 import quiet

    with quiet():
        return _run(ctx, row, opts)


def _run(ctx, row: Row, opts) -> list:
    import logging

    import torch

    from moebench.libraries.resume import refusal, restore_comparisons, shared_dir
    from moebench.parity.compare import EXACT, assertion, compare
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER

    for name in ("torchtitan", "torch.distributed.checkpoint"):  # the checkpointer's info lines
        logging.getLogger(name).setLevel(logging.WARNING)
    from moebench.libraries.torchtitan.bf16 import setup_rank

    gen = setup_rank(row)
    r, w = ctx.rank, ctx.world_size
    s = row.settings
    out: list = []
    against: list = []  # the uninterrupted run against one process: kept aside, after the resume's comparisons
    save_ep = getattr(s, "save_ep", 0) or w
    a = _make(gen, row, "ep", opts.seed, w, save_ep)
    for step in range(SAVE_STEPS):
        against += _step_against_one_process(gen, row, a, step, opts.seed, r, w)
        out.append(_biases_agree(a, r, f"step {step + 1}"))
    saved = _state(a)
    moved = bool(saved["bias"][BIAS].abs().sum() > 0)
    out.append(assertion(f"the expert bias moved in {SAVE_STEPS} steps (the row checks a state that changes)", moved,
                         rank=r, group=ROUTER, note="" if moved else "it is still all zeros: nothing to restore"))
    with shared_dir("torchtitan-resume") as folder:
        _checkpointer(gen, str(folder), a[0], a[2]).save(curr_step=SAVE_STEPS)
        torch.distributed.barrier()
        b = _make(gen, row, s.load_ep_mode, opts.seed + FRESH_SEED_OFFSET, w)
        fresh = _state(b)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: every rank's errors

        try:
            _checkpointer(gen, str(folder), b[0], b[2]).load(step=SAVE_STEPS)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the load refused is the row's verdict
            from moebench.parity.registry import Refused

            raise Refused(f"CheckpointManager.load refused it: {refusal(exc)}") from None
    out += restore_comparisons(_findings(b, saved, fresh, r, w, s.load_ep_mode), r)
    if s.load_ep_mode != "ep" or save_ep != w:
        return out + against  # another layout: its reductions differ; what it restored is what is asked of it
    for step in range(SAVE_STEPS, SAVE_STEPS + CONTINUE_STEPS):
        against += _step_against_one_process(gen, row, a, step, opts.seed, r, w)
        _train(b, step, opts.seed, r, w)
        kept, resumed = _state(a), _state(b)
        for name, t in resumed["weights"].items():
            group = EXPERTS if is_expert(gen, name) else ROUTER if "router" in name else REPLICATED
            out.append(compare(f"step {step + 1} (resumed): {name} vs the run that never stopped", t,
                               kept["weights"][name], EXACT, rank=r, group=group))
        out.append(compare(f"step {step + 1} (resumed): the expert bias vs the run that never stopped",
                           resumed["bias"][BIAS], kept["bias"][BIAS], EXACT, rank=r, group=ROUTER))
    return out + against


def _step_against_one_process(gen: str, row: Row, a, step: int, seed: int, rank: int, world: int) -> list:
    """One step of the uninterrupted run against one process, from the same weights and expert bias: its gradients
    (after the data-parallel sums) against the MoE in float32 (bf16.reference, the bias choosing the experts): the
    router's and the experts' judged by the noise model, the baseline being torchtitan's own module with nothing
    parallelized (its grouped experts compute in bf16), the shared expert's (plain float32 linears) strictly; and
    its expert bias after the optimizers' step (torchtitan's
    hook) against the hook's update from every token's expert count (train.bias_update), strictly.
    Gradients, not weights after Adam: Adam's first steps turn a rounding difference of a near-zero gradient into up
    to lr."""
    import torch

    from moebench.libraries.torchtitan.bf16 import GROUP_OF, WORDS, reference
    from moebench.libraries.torchtitan.train import bias_update
    from moebench.parity import noise
    from moebench.parity.compare import STRICT, assertion, compare
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER, make

    spec = api.spec_of(row)
    before = _state(a)
    x_all, t_all = _batch(seed, step, world)
    tokens = x_all.shape[0] * x_all.shape[1]
    names = {name: role for role, name in api.names(gen).items() if name in before["weights"]}
    truth = {role: before["weights"][name].float().clone().requires_grad_(True) for name, role in names.items()}
    counts = torch.zeros(spec.num_experts, dtype=torch.float64)
    y = reference(truth, x_all.reshape(-1, api.HIDDEN), spec, api.score_before_experts(gen),
                  bias=before["bias"][BIAS].float(), counts=counts)
    ((y * t_all.reshape(-1, api.HIDDEN)).sum() / tokens).backward()
    base = api.build(gen, row.model, enable_ep=False, enable_sp=False, load_balance_coeff=LOAD_BALANCE_COEFF)
    with torch.no_grad():  # torchtitan's module on this process alone, from the run's weights and bias
        for name, p in base.named_parameters():
            p.copy_(before["weights"][name])
        getattr(base, bias_name(gen)).copy_(before["bias"][BIAS])
    ((base(x_all.clone()).float() * t_all).sum() / tokens).backward()
    base_grads = dict(base.named_parameters())
    grads: dict = {}
    _train(a, step, seed, rank, world, grads=grads)
    run_sums = {g: torch.zeros(3, dtype=torch.float64) for g in (ROUTER, EXPERTS)}
    base_sums = {g: torch.zeros(3, dtype=torch.float64) for g in run_sums}
    out = []
    for name, role in names.items():  # a parameter without a gradient is held as zeros (a detached path)
        group, want = GROUP_OF.get(role, REPLICATED), truth[role].grad
        grads.setdefault(name, torch.zeros_like(want))
        if base_grads[name].grad is None:
            base_grads[name].grad = torch.zeros_like(base_grads[name])
        if group == REPLICATED:  # the shared expert computes in float32 (plain linears): held to float32 strictly
            out.append(compare(f"step {step + 1} (uninterrupted): grad {name} vs one process", grads[name].float(),
                               want, STRICT, rank=rank, group=group))
            continue
        run_sums[group] += noise.sums([(grads[name].float(), want)])
        base_sums[group] += noise.sums([(base_grads[name].grad.float(), want)])
    for group in (ROUTER, EXPERTS):
        agrees = noise.distance(base_sums[group])
        held = assertion(f"step {step + 1}: torchtitan's module on one process is the float32 mathematics: its "
                         f"{WORDS[group]} gradient is {agrees:.3g} from it (<= {BASELINE_AGREES:g})",
                         agrees <= BASELINE_AGREES, rank=rank, group=group)
        if not held.passed:
            found = noise.fit(base_sums[group])
            scaled = f" (x {found[0]:.3g})" if found and found[1] <= noise.GROUP_FIT_RTOL else ""
            held.diagnosis = make("one-process-differs", f"differs from the float32 mathematics on one process too, "
                                  f"before any resume: at step {step + 1} torchtitan's {WORDS[group]} gradient is "
                                  f"{agrees:.3g} from float32{scaled}, and the run that never stopped shares it")
        out.append(held)
        judged = noise.judge(f"step {step + 1} (uninterrupted)", f"{WORDS[group]} gradient vs one process",
                             run_sums[group], base_sums[group], rank=rank, group=group)
        if not judged.passed:
            found = noise.fit(run_sums[group])
            scaled = (f": the one-process gradient x {found[0]:.3g}" if found and found[1] <= noise.GROUP_FIT_RTOL
                      else "")
            judged.diagnosis = make("one-process-differs", f"the run that never stopped differs from one process "
                                    f"at step {step + 1}, before any resume: the {WORDS[group]} gradient{scaled}")
        out.append(judged)
    bias = _state(a)["bias"][BIAS]
    out.append(compare(f"step {step + 1} (uninterrupted): the expert bias after the step vs one process",
                       bias.float(), bias_update(before["bias"][BIAS].float(), counts, LOAD_BALANCE_COEFF), STRICT,
                       rank=rank, group=ROUTER))
    return out
