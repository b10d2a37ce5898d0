"""Standalone reproduction: megatron-core's MoE layer through its DDP, finalize_model_grads and optimizer (Adam with
clipping) over W gloo ranks on CPU, against the same mathematics on one process.

Needs only Python, torch and megatron-core. Run: `python THIS_FILE` (option: --deadline SECONDS).
Exit status: 1 the bug shows (the first diverging quantity is printed), 0 it does not, 2 setup error.

Ranks: what moebench's row builds (pasted below from moebench/libraries/megatron/step.py): initialize_model_parallel
with the row's TP / EP / ETP, the MoE module of Megatron's GPT layer spec without Transformer Engine, its
DistributedDataParallel, finalize_model_grads and get_megatron_optimizer, each step through its forward-backward
schedule and optimizer.step(). On CPU through the stand-ins pasted from moebench/libraries/megatron/standins.py, in the
ranks only (its docstring lists each and why; the header printed below names them).
Reference: plain torch on one process (moebench/libraries/megatron/reference.py, pasted): the router, top-k, capacity,
aux and z losses, SwiGLU experts, the clip and AdamW, from Megatron's documented definitions.
Compared at every step, in this order: each rank's output, every gradient after finalize_model_grads (each expert by
its global index and ETP slice), the gradient norm the optimizer clips by, the input gradient, the expert bias, and
every parameter after the step.

This file is moebench's template (moebench/libraries/megatron/repro_main.py): moebench pastes the harness and the four
files in place of the lines marked @...@ and drops the lines marked PASTED.
"""

# ruff: noqa: F405
import sys

from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)

from moebench.libraries.megatron.reference import Reference  # @PASTED@
from moebench.libraries.megatron.standins import STANDINS, import_megatron, in_rank  # @PASTED@
from moebench.libraries.megatron.step import (  # @PASTED@
    ADAM_BETAS,  # @PASTED@
    ADAM_EPS,  # @PASTED@
    CLIP,  # @PASTED@
    LR,  # @PASTED@
    MICRO,  # @PASTED@
    MODULES,  # @PASTED@
    SEQ,  # @PASTED@
    WEIGHT_DECAY,  # @PASTED@
    batch,  # @PASTED@
    build,  # @PASTED@
    chunk,  # @PASTED@
    initial_values,  # @PASTED@
    layout,  # @PASTED@
    layout_pieces,  # @PASTED@
    slice_label,  # @PASTED@
    teardown,  # @PASTED@
    train_step,  # @PASTED@
)  # @PASTED@

SETTINGS = json.loads('{"world_size": 2, "seed": 0}')  # @SETTINGS@ (filled by moebench)

# @TRITON@
# @STANDINS@
# @STEP@
# @REFERENCE@

STEPS = 2
KINDS = ("output", "gradient", "gradient norm", "input gradient", "expert bias", "parameter after the step")


def group_of(unit):
    return "router" if unit == "router" else "expert" if unit.startswith("expert") else "shared expert"


def library_rank(rank, world, store_path, out, deadline):
    """One Megatron rank: the row's model, STEPS training steps, its records."""
    import contextlib
    import logging
    import warnings

    watchdog(deadline)
    phase = SETUP
    try:
        gloo(rank, world, store_path, deadline)
        import torch

        import_megatron(*MODULES)
        records = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            logging.getLogger("megatron").setLevel(logging.ERROR)
            stack.enter_context(in_rank())
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.callback(teardown)
            run = build(SETTINGS, SETTINGS["seed"], world)
            phase = TRAINING
            ranks = run.ranks
            where = f"dp {ranks['dp']}, tp {ranks['tp']}"
            for k in range(STEPS):
                rec = train_step(run, SETTINGS["seed"], k, world)
                records.append((k, 0, f"output ({where})", "output", rec.output))
                for name, held in run.held.items():
                    for piece in held:
                        label = f"{piece.unit}{slice_label(piece.index)}"
                        if not SETTINGS["distributed_optimizer"]:  # else each gradient is left reduce-scattered
                            records.append((k, 1, f"grad {label}", group_of(piece.unit),
                                            piece.view(rec.grads[name])))
                        records.append((k, 5, label, group_of(piece.unit), piece.view(rec.params[name])))
                if rec.grad_norm is not None:
                    records.append((k, 2, "gradient norm", "replicated", torch.tensor([rec.grad_norm])))
                records.append((k, 3, f"input gradient ({where})", "input", rec.input_grad))
                if rec.expert_bias is not None:
                    records.append((k, 4, "router expert_bias", "router", rec.expert_bias))
        save(out, rank, {"records": records})
    except Exception:  # noqa: BLE001 - reported by the parent
        fail(out, rank, phase)
        raise


def reference_rank(world, store_path, out, deadline):
    """The same mathematics on one process: every record the ranks make, for every rank's chunk and piece."""
    watchdog(deadline)
    phase = SETUP
    try:
        import torch

        sizes = layout(SETTINGS, world)
        tp, dp = sizes["tp"], sizes["dp"]
        ref = Reference(SETTINGS, initial_values(SETTINGS, SETTINGS["seed"]), seq=SEQ, micro=MICRO, lr=LR,
                        betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY, clip=CLIP)
        phase = TRAINING
        scale = SEQ * MICRO * dp if SETTINGS.get("per_token") else dp
        records = []
        for k in range(STEPS):
            x_all, t_all = batch(SETTINGS, SETTINGS["seed"], k, world)
            res = ref.step(x_all, t_all, tp, dp)
            for d in range(dp):
                for t in range(tp):
                    where = f"dp {d}, tp {t}"
                    records.append((k, 0, f"output ({where})", "output", chunk(res.output, t, d, tp)))
                    records.append((k, 3, f"input gradient ({where})", "input",
                                    chunk(res.input_grad, t, d, tp) * scale))
            for unit, index in layout_pieces(SETTINGS):
                label = f"{unit}{slice_label(index)}"
                if not SETTINGS["distributed_optimizer"]:
                    records.append((k, 1, f"grad {label}", group_of(unit), res.grads[unit][index]))
                records.append((k, 5, label, group_of(unit), res.values[unit][index]))
            records.append((k, 2, "gradient norm", "replicated", torch.tensor([res.grad_norm])))
            if res.expert_bias is not None:
                records.append((k, 4, "router expert_bias", "router", res.expert_bias))
        save(out, "reference", {"records": records})
    except Exception:  # noqa: BLE001 - reported by the parent
        fail(out, "reference", phase)
        raise


def mechanism(kind, rows):
    """What the first divergence points at, in one sentence."""
    if kind == 0:
        return "The forward pass differs: the router, the token dispatch or the experts."
    if kind in (1, 3):
        k = rows_factor(rows)
        factor = "varying factors" if k is None else f"{k:.4g}"
        groups = ", ".join(sorted({r[4] for r in rows}))
        return (f"The forward agrees, the gradients of the {groups} group(s) do not (scaled by {factor}): the "
                "backward exchange, DDP's reduction, finalize_model_grads or the aux-loss scaling.")
    if kind == 2:
        return ("The gradients agree, the norm the optimizer clips by does not: which gradients it counts, or over "
                "which ranks it sums them.")
    if kind == 4:
        return "The expert bias update differs: the token counts finalize_model_grads reduces."
    return "The gradients agree, the parameters after the step do not: the optimizer or its clip."


def describe():
    import importlib.metadata

    version = importlib.metadata.version("megatron-core")
    shown = ", ".join(f"{k}={v}" for k, v in SETTINGS.items() if k not in ("standins", "torch_compile"))
    return (f"megatron-core {version} MoE layer + DDP + finalize_model_grads + Adam, {SETTINGS['world_size']} gloo "
            f"ranks: {shown}; stand-ins ({STANDINS})")


if __name__ == "__main__":
    sys.exit(main(world=SETTINGS["world_size"], library_rank=library_rank, reference_rank=reference_rank,
                  describe=describe, kinds=KINDS, mechanism=mechanism))
