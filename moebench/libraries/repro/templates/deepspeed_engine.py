"""Standalone reproduction: DeepSpeed MoE trained through deepspeed.initialize over W gloo ranks on CPU,
against the same mathematics on one process: the row of `moebench verify-parity --library deepspeed` named on
the first line, with its settings, seed and data.

Needs only Python, torch and deepspeed. Run: `python THIS_FILE` (option: --deadline SECONDS).
Exit status: 1 the bug shows (the first diverging quantity is printed), 0 it does not, 2 setup error.

The model, its data and the one-process reference are the tool's own (pasted below from moebench: the tiny
net around deepspeed.moe.layer.MoE, every expert seeded by its GLOBAL index so every ep_size builds the same
model; the row's batches; the reference step), so this script and the tool print the same figures.
Engine: W ranks, `deepspeed.initialize` with torch's SGD (not Adam: Adam divides by the gradient's own size, so
a gradient scaled by k would move the weights almost as the right one does) and the row's config. DeepSpeed's
CPU comm backend would JIT-build its shared-memory op; it is marked incompatible in
`deepspeed.ops.__compatible_ops__` (DeepSpeed's own switch) so gloo does the collectives.
Reference: one process, the same weights, DeepSpeed's MoE at ep_size = 1 applied to each rank's slice of the
batch (capacity is per rank), gradients averaged over the W ranks and the accumulation micro-steps, clipped by
the global norm, plain SGD (p -= lr * g).
Compared at every optimizer step, in this order: each rank's loss, the gradient after the engine's reduction
(before clipping), the engine's global gradient norm (ZeRO 1/2 with clipping, where it keeps one), the update the
step applied (after - before = -lr x clipped gradient), and each parameter after the step. The first quantity
that differs is the bug; what follows it is its consequence.
"""

# ruff: noqa: F405
import os
import sys
import types

from engine_reading import *  # noqa: F403  @ENGINEREADING@ (moebench pastes templates/engine_reading.py here)
from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)
from noisemath import *  # noqa: F403  @NOISEMATH@ (moebench pastes moebench/parity/noisemath.py here)
from rowmath import *  # noqa: F403  @ROWMATH@ (moebench pastes moebench/libraries/deepspeed/rowmath.py here)
from tinymoe import *  # noqa: F403  @TINYMOE@ (moebench pastes moebench/models/deepspeed_moe.py here)

SETTINGS = json.loads('{"zero_stage": 1, "ep_size": 2, "world_size": 2}')  # @SETTINGS@ (filled by moebench)
ROW = types.SimpleNamespace(**{"grad_accum": 1, "clip": 0.0, "precision": "fp32", "top_k": 1, "drop_tokens": False,
                               "use_residual": False, "steps": STEPS, "loss_multiplier": 1.0, **SETTINGS})
KINDS = ("loss", "reduced gradient", "global norm", "applied update", "parameter after the step")
LOSS, GRAD, NORM, UPDATE, AFTER = range(len(KINDS))
READS_NORM = ROW.clip > 0 and ROW.zero_stage > 0
"""The tool reads the engine's global norm where DeepSpeed keeps one: ZeRO 1/2 with clipping."""
PREFIX = "moe.moe.deepspeed_moe.experts.deepspeed_experts."


def group_of(name):
    if name.startswith(PREFIX):
        return "expert"
    if ".gate.wg." in name:
        return "gate"
    if ".moe.mlp." in name or ".moe.coefficient." in name:
        return "residual"
    return "dense"


def global_name(name, ep_rank, local):
    """A local expert parameter's name -> the same expert's name at ep_size = 1 (contiguous layout)."""
    if not name.startswith(PREFIX):
        return name
    slot, rest = name[len(PREFIX):].split(".", 1)
    return f"{PREFIX}{ep_rank * local + int(slot)}.{rest}"


def engine_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: the engine as DeepSpeed's users run it; records what it did."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch

        init_deepspeed(rank, world, store_path, deadline)
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        from deepspeed.utils import groups as ds_groups
        from deepspeed.utils import safe_get_full_grad

        ep, experts, accum, seed = ROW.ep_size, EXPERTS_PER_RANK * world, ROW.grad_accum, ROW.seed
        create_expert_groups(ep)
        ep_rank = ds_groups._get_expert_parallel_rank(f"ep_size_{ep}")
        model = TinyMoENet(moe_fields(ROW, ep), experts, seed, ep_rank, d_model=D_MODEL)
        local = model.moe.num_local_experts
        param_groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(param_groups, lr=LR),
                                          config=engine_config(ROW, world))
        names = [(global_name(n, ep_rank, local), p) for n, p in engine.module.named_parameters()]
        records = []
        phase = TRAINING
        for step in range(ROW.steps):
            for micro in range(accum):
                x, y = batch(seed, ROW.zero_stage, step, micro, rank, ROW)
                loss = loss_of(engine, x, y, ROW.loss_multiplier)
                records.append((step, LOSS, f"loss (rank {rank}, micro-step {micro + 1})", "loss",
                                loss.detach().double().reshape(1)))
                engine.backward(loss)
                if micro == accum - 1:  # the boundary: gradients reduced, the step not yet taken
                    for gname, p in names:
                        grad = safe_get_full_grad(p)  # a collective at ZeRO 1/2: every rank, same order
                        if grad is not None:
                            records.append((step, GRAD, f"{gname} reduced gradient", group_of(gname),
                                            grad.detach().double().clone()))
                    before = {gname: p.detach().double().clone() for gname, p in names}
                engine.step()  # after every backward: DeepSpeed counts micro-steps here
            norm = engine.get_global_grad_norm() if READS_NORM and hasattr(engine, "get_global_grad_norm") else None
            if norm is not None:
                records.append((step, NORM, f"global gradient norm (rank {rank})", "all", torch.tensor(
                    [float(norm)], dtype=torch.float64)))
            for gname, p in names:
                after = p.detach().double().clone()
                records.append((step, UPDATE, f"{gname} update applied by the step", group_of(gname),
                                after - before[gname], before[gname]))
                records.append((step, AFTER, f"{gname} after the step", group_of(gname), after))
        save(out, rank, {"records": records, "held": [gname for gname, _ in names]})
        phase = "teardown"
        ds_dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def reference_rank(world, store_path, out, deadline):
    """The reference: one process, ep_size = 1, each rank's slice through the same layer (rowmath.reference_step,
    the tool's own reference)."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        init_deepspeed(0, 1, store_path, deadline)
        experts = EXPERTS_PER_RANK * world
        create_expert_groups(1)
        model = TinyMoENet(moe_fields(ROW, 1), experts, ROW.seed, 0, d_model=D_MODEL)
        model.moe.moe.set_deepspeed_parallelism()
        records, steps = [], []
        phase = TRAINING
        for step in range(ROW.steps):
            before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            ref = reference_step(model, ROW, world, ROW.seed, step)
            for micro, losses in enumerate(ref.slice_losses):
                for rank, value in enumerate(losses):
                    records.append((step, LOSS, f"loss (rank {rank}, micro-step {micro + 1})", "loss",
                                    torch_tensor([value])))
            for rank in range(world if READS_NORM else 0):
                records.append((step, NORM, f"global gradient norm (rank {rank})", "all", torch_tensor([ref.norm])))
            for n, p in model.named_parameters():
                records.append((step, GRAD, f"{n} reduced gradient", group_of(n), ref.grad[n]))
                records.append((step, UPDATE, f"{n} update applied by the step", group_of(n), ref.update[n],
                                before[n]))
                records.append((step, AFTER, f"{n} after the step", group_of(n), p.detach().double().clone()))
            steps.append({"norm": ref.norm, "coef": ref.coef, "grad": ref.grad})
        save(out, "reference", {"records": records, "steps": steps})
    except BaseException:  # noqa: BLE001
        fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def torch_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.float64)


def describe():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    keys = ("zero_stage", "ep_size", "grad_accum", "clip", "precision", "top_k", "drop_tokens", "use_residual",
            "steps", "seed")
    shown = ", ".join(f"{k}={SETTINGS[k]}" for k in keys if k in SETTINGS)
    if ROW.loss_multiplier != 1.0:
        shown += f", loss x {ROW.loss_multiplier:g} (so that the clip binds on this small model)"
    return f"DeepSpeed {deepspeed.__version__} engine, {SETTINGS['world_size']} gloo ranks: {shown}"


FORWARD_DIFFERS = "The forward pass differs (the gate, the experts' exchange or the model itself)."
"""What mechanism() says when the loss differs first."""

if __name__ == "__main__":
    sys.exit(main(world=int(SETTINGS["world_size"]), library_rank=engine_rank, reference_rank=reference_rank,
                  describe=describe, kinds=KINDS, where=f" at ZeRO {SETTINGS['zero_stage']}", mechanism=mechanism,
                  notes=notes))
