"""Standalone reproduction: DeepSpeed AutoEP (a Hugging Face MoE model made expert-parallel inside
deepspeed.initialize by "expert_parallel": {"enabled": true, "autoep_size": E}) over W gloo ranks on CPU, against the
same model on one process: the row of `moebench verify-parity --library autoep` named on the first line, with its
settings, seed and data.

Needs only Python, torch, deepspeed and transformers. Run: `python THIS_FILE` (option: --deadline SECONDS).
Exit status: 1 the bug shows (the first diverging quantity is printed; deepspeed.initialize raising counts), 0 it
does not, 2 setup error.

The model, its data and the one-process reference are the tool's own (pasted below from moebench: the family's tiny
config and seeded weights, nothing downloaded; the row's batches; the reference step; how AutoEP's grouped experts
map onto the model's, every expert by its GLOBAL index), so this script and the tool print the same figures.
Engine: W ranks, `deepspeed.initialize` with the row's config (SGD: a config-built one unless the row names a
client optimizer; not Adam, which would step a uniformly scaled gradient almost as the right one). DeepSpeed's CPU
comm backend would JIT-build its shared-memory op; it is marked incompatible in `deepspeed.ops.__compatible_ops__`
(DeepSpeed's own switch) so gloo does the collectives. With transformers 5.23+ a row that names the shim applies it
(install_registry_shim, pasted below): AutoEP as shipped cannot use that transformers' output-capture registry.
Reference: one process, the Hugging Face model itself on each rank's slice, gradients averaged over the ranks and
the accumulation micro-steps, clipped by the global norm, plain SGD (p -= lr * g).
Compared at every optimizer step, in this order: each rank's loss, the gradient after the engine's reduction
(before clipping), the engine's global gradient norm (ZeRO 1/2 with clipping), the update the step applied and
each parameter after the step. The first quantity that differs is the bug; what follows it is its consequence.
"""

# ruff: noqa: F405
import os
import re
import sys
import types

# In this order (the names sort so): the matrix's shape, the reading of a divergence (functions only), the engine
# rows' rowmath, the harness, the noise model (its common factor reads an update), then the AutoEP rowmath, which
# redefines the names both have (batch, LR, ...).
from autoep_shape import *  # noqa: F403  @AUTOEPSHAPE@ (moebench pastes moebench/libraries/autoep/shape.py here)
from engine_reading import *  # noqa: F403  @ENGINEREADING@ (moebench pastes templates/engine_reading.py here)
from engine_rowmath import *  # noqa: F403  @ROWMATH@ (moebench pastes moebench/libraries/deepspeed/rowmath.py here)
from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)
from noisemath import *  # noqa: F403  @NOISEMATH@ (moebench pastes moebench/parity/noisemath.py here)
from rowmath import *  # noqa: F403  @AUTOEPMATH@ (moebench pastes moebench/libraries/autoep/rowmath.py here)

TINY_EXPERT_PREFIX = "\0"  # the engine rowmath's names of the tiny DeepSpeed model: none in an AutoEP script

SETTINGS = json.loads('{"family": "mixtral", "zero_stage": 0, "autoep_size": 2, "world_size": 2}')  # @SETTINGS@
ROW = types.SimpleNamespace(**{"top_k": 2, "grad_accum": 1, "clip": 0.0, "precision": "fp32",
                               "data_before_expert": False, "optimizer": "config", "transformers_shim": "",
                               "steps": STEPS, "loss_multiplier": 1.0, "seqs": SEQS, "config": None,
                               "norm_topk_prob": False, "aux_loss": False, **SETTINGS})
KINDS = ("loss", "reduced gradient", "global norm", "applied update", "parameter after the step")
LOSS, GRAD, NORM, UPDATE, AFTER = range(len(KINDS))
READS_NORM = ROW.clip > 0 and ROW.zero_stage > 0
"""The tool reads the engine's global norm where DeepSpeed keeps one: ZeRO 1/2 with clipping."""
INITIALIZE = "deepspeed.initialize"
"""The phase a rank is in while AutoEP converts the model: an error there is the library's (exit 1), not setup."""


def compared(unit):
    """A unit's gradient and update are compared unless they are zero in exact arithmetic (Mixtral's router at
    top-1: its weight is normalised over one expert, w = s / s = 1), where both sides hold rounding only."""
    return group_of(unit) != "router" or router_gets_gradient(ROW.family, ROW.top_k, ROW.norm_topk_prob, ROW.aux_loss)


def engine_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: AutoEP as DeepSpeed's users run it; records what it did."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch

        init_deepspeed(rank, world, store_path, deadline, quiet_transformers=True)
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.utils import safe_get_full_grad

        if ROW.transformers_shim and registry_needs_shim():
            install_registry_shim()
        model = build(ROW.family, ROW.top_k, ROW.seed, ROW.config, ROW.seqs)
        kept = {id(p): n for n, p in model.named_parameters()}
        optimizer, params = client_optimizer(ROW, model)
        phase = INITIALIZE
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=params,
                                          config=engine_config(ROW, world))
        phase = TRAINING
        moe = engine.module.get_submodule(MLP[:-1])
        held = experts_held(moe)
        names = dict(engine.module.named_parameters())

        def units(tensors):
            """{unit: tensor}: AutoEP's grouped experts by global expert, its router under the model's name `gate`,
            every kept parameter under the model's own name (found by identity)."""
            found = {}
            for n, t in tensors.items():
                if re.fullmatch(re.escape(MLP) + r"experts\.w[123]", n) or n.startswith(MLP + "router.gate."):
                    found.update(autoep_units({n: t}, held))
                else:
                    found[kept[id(names[n])]] = t
            return found

        records = []
        for step in range(ROW.steps):
            before = units({n: p.detach().double().clone() for n, p in names.items()})
            for micro in range(ROW.grad_accum):
                loss = loss_of(engine, batch(ROW.seed, step, micro, rank, ROW.seqs, model.config.vocab_size),
                               ROW.loss_multiplier)
                records.append((step, LOSS, f"loss (rank {rank}, micro-step {micro + 1})", "loss",
                                loss.detach().double().reshape(1)))
                engine.backward(loss)
                if micro == ROW.grad_accum - 1:  # the boundary: gradients reduced, the step not yet taken
                    grads = units({n: g.detach().double().clone() for n, p in names.items()
                                   if (g := safe_get_full_grad(p)) is not None})  # a collective at ZeRO 1/2
                    records += [(step, GRAD, f"{label(u)} reduced gradient", group_of(u), g)
                                for u, g in grads.items() if compared(u)]
                engine.step()  # after every backward: DeepSpeed counts micro-steps here
            norm = engine.get_global_grad_norm() if READS_NORM else None
            if norm is not None:
                records.append((step, NORM, f"global gradient norm (rank {rank})", "all",
                                torch.tensor([float(norm)], dtype=torch.float64)))
            for u, after in units({n: p.detach().double().clone() for n, p in names.items()}).items():
                if compared(u):
                    records.append((step, UPDATE, f"{label(u)} update applied by the step", group_of(u),
                                    after - before[u], before[u]))
                records.append((step, AFTER, f"{label(u)} after the step", group_of(u), after))
        save(out, rank, {"records": records, "held": list(before)})
        phase = "teardown"
        ds_dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def reference_rank(world, store_path, out, deadline):
    """The reference: the Hugging Face model on one process, each rank's slice through it (rowmath.reference_step,
    the tool's own reference)."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch

        model = build(ROW.family, ROW.top_k, ROW.seed, ROW.config, ROW.seqs)
        records, steps = [], []
        phase = TRAINING
        for step in range(ROW.steps):
            before = reference_units({n: p.detach().double().clone() for n, p in model.named_parameters()})
            ref = reference_step(model, ROW, world, ROW.seed, step)
            for micro, losses in enumerate(ref.slice_losses):
                for rank, value in enumerate(losses):
                    records.append((step, LOSS, f"loss (rank {rank}, micro-step {micro + 1})", "loss",
                                    torch.tensor([value], dtype=torch.float64)))
            for rank in range(world if READS_NORM else 0):
                records.append((step, NORM, f"global gradient norm (rank {rank})", "all",
                                torch.tensor([ref.norm], dtype=torch.float64)))
            for u in ref.grad:
                if compared(u):
                    records.append((step, GRAD, f"{label(u)} reduced gradient", group_of(u), ref.grad[u]))
                    records.append((step, UPDATE, f"{label(u)} update applied by the step", group_of(u),
                                    ref.update[u], before[u]))
                records.append((step, AFTER, f"{label(u)} after the step", group_of(u), ref.after[u]))
            steps.append({"norm": ref.norm, "coef": ref.coef, "grad": ref.grad})
        save(out, "reference", {"records": records, "steps": steps})
    except BaseException:  # noqa: BLE001
        fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def describe():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import transformers

    keys = ("family", "zero_stage", "autoep_size", "top_k", "grad_accum", "clip", "data_before_expert", "optimizer",
            "steps", "seed")
    shown = ", ".join(f"{k}={SETTINGS[k]}" for k in keys if k in SETTINGS)
    if ROW.loss_multiplier != 1.0:
        shown += f", loss x {ROW.loss_multiplier:g} (so that the clip binds on this small model)"
    shim = (" with the registry shim (AutoEP as shipped cannot use this transformers)"
            if ROW.transformers_shim and registry_needs_shim() else "")
    return (f"DeepSpeed {deepspeed.__version__} AutoEP, transformers {transformers.__version__}{shim}, "
            f"{SETTINGS['world_size']} gloo ranks: {shown}")


FORWARD_DIFFERS = "The forward pass differs (the router, the experts' exchange or the conversion of the model)."
"""What mechanism() says when the loss differs first."""

if __name__ == "__main__":
    sys.exit(main(world=int(SETTINGS["world_size"]), library_rank=engine_rank, reference_rank=reference_rank,
                  describe=describe, kinds=KINDS, where=f" at ZeRO {SETTINGS['zero_stage']}", mechanism=mechanism,
                  notes=notes))
