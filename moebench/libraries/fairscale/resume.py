"""fairscale resume row: a state_dict round trip of MOELayer (+ Top2Gate) under expert parallelism.

fairscale has no checkpoint API for its MoE layer: its users save what torch gives them. On every rank (2 experts
a rank, the layer built as the adapter builds it):
1. SAVE_STEPS steps of torch Adam (fairscale's expert-marked gradients synchronised as the adapter does);
2. each rank saves `{"model": layer.state_dict(), "optimizer": optimizer.state_dict()}` to its own file in a
   folder every rank sees (the experts in it are that rank's, under their LOCAL names `experts.0.*`);
3. the uninterrupted run continues CONTINUE_STEPS steps;
4. a fresh layer and Adam built from a DIFFERENT seed load the rank's file (`load_state_dict` both);
5. right after the load, per GLOBAL expert (rank r's local expert j is expert r x 2 + j) and for the gate:
   weights, exp_avg, exp_avg_sq and step identified (moebench.parity.restore) as restored, another expert's,
   the fresh layer's, or none of these; then CONTINUE_STEPS resumed steps vs the uninterrupted ones: the loss
   and every parameter, bit for bit (same layout, same order of every sum).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moebench.libraries.fairscale import parity as fs
from moebench.libraries.spec import RESUME, Row, Settings
from moebench.parity.diagnosis import EXPERTS, OUTPUT
from moebench.parity.layout import ExpertLayout

PER_RANK = 2
"""Experts a rank: two, so a slot can hold the other local expert's state, not only another rank's."""
SAVE_STEPS = 2
CONTINUE_STEPS = 2
ADAM_LR = 1e-2
FRESH_SEED_OFFSET = 7_919
"""The fresh layer's seed is the row's plus this: nothing it holds equals the trained layer's state."""
OPTIMIZER_QUANTITIES = ("exp_avg", "exp_avg_sq", "step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeSettings(Settings):
    ep_size: int
    save_steps: int = SAVE_STEPS
    continue_steps: int = CONTINUE_STEPS
    load_optimizer_states: bool = True


def resume_row(world_size: int, ep_mode: str) -> Row:
    return Row(library="fairscale", model="top2gate", backend="-", ep_mode=ep_mode, world_size=world_size,
               kind=RESUME, features=("resume",), variant="resume", settings=ResumeSettings(ep_size=world_size))


def _layer(seed: int, rank: int, world: int, moe_layer_cls, gate_cls):
    """fairscale's layer on this rank, its weights from `seed` (every expert's drawn, this rank's kept)."""
    experts = PER_RANK * world
    torch.manual_seed(seed)
    gate = gate_cls(fs.D_MODEL, experts)
    everyone = [fs.FFN() for _ in range(experts)]
    with torch.no_grad():  # equal-norm gate rows, as the adapter: every expert gets tokens
        gate.wg.weight /= gate.wg.weight.norm(dim=1, keepdim=True)
    return moe_layer_cls(gate, nn.ModuleList(everyone[rank * PER_RANK:(rank + 1) * PER_RANK]))


def _steps(layer, opt, seed: int, steps: range, rank: int, world: int) -> list[float]:
    """Adam steps; the global loss of each (the mean over every rank's tokens)."""
    import torch.distributed as dist

    experts = PER_RANK * world
    tokens = fs.TOKENS_PER_EXPERT * experts
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x_all = torch.randn(world, tokens, fs.D_MODEL, generator=g)
        weights = torch.randn(world, tokens, fs.D_MODEL, generator=g)
        rows = layer.gate.wg.weight.detach()
        for e in range(experts):  # every rank sends every expert a slot
            x_all[:, e] = fs.TOKEN_SCALE * rows[e] / rows[e].norm()
        torch.manual_seed(fs.noise_seed(seed, step, rank))  # top2gating draws its noise here
        y = layer(x_all[rank].view(2, tokens // 2, fs.D_MODEL)).reshape(tokens, fs.D_MODEL)
        loss = (y * weights[rank]).mean()
        loss.backward()
        fs.sync_gradients(layer, world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _unit(name: str, layout: ExpertLayout, rank: int) -> tuple[str, int | None, int | None]:
    """ "experts.1.fc2.weight" on rank r -> ("experts.fc2.weight", local 1, its global expert); others as is."""
    found = layout.split_name(name, fs.EXPERT_PREFIX)
    if found is None:
        return name, None, None
    slot, rest = found
    return f"{fs.EXPERT_PREFIX}{rest}", slot, layout.global_expert(rank, slot)


def _state(layer, opt) -> dict[str, dict[str, torch.Tensor]]:
    """local parameter name -> {quantity: tensor}: the weights and the Adam state this rank holds."""
    out = {}
    for name, p in layer.named_parameters():
        state = opt.state.get(p, {}) if opt is not None else {}
        out[name] = {"weights": p.detach().clone()}
        for q in OPTIMIZER_QUANTITIES:
            fresh = torch.zeros(()) if q == "step" else torch.zeros_like(p)
            out[name][q] = torch.as_tensor(state.get(q, fresh)).detach().clone()
    return out


def _findings(got: dict, fresh: dict, everyone: list[dict], rank: int) -> list:
    layout = ExpertLayout(PER_RANK * len(everyone), len(everyone))
    """(comparison name, Finding) of every local expert slot and gate parameter, every quantity."""
    from moebench.parity import restore

    want: dict[str, dict[str, dict]] = {}  # unit name -> quantity -> {global expert or name: tensor}
    for r, held in enumerate(everyone):
        for name, quantities in held.items():
            unit, _, e = _unit(name, layout, r)
            for q, t in quantities.items():
                want.setdefault(unit, {}).setdefault(q, {})[unit if e is None else e] = t
    out = []
    for name, quantities in got.items():
        unit, j, e = _unit(name, layout, rank)
        for q, t in quantities.items():
            slot = restore.Slot(rank=rank, local=j, unit=unit if e is None else e)
            label = f"restored {unit} {q}" if e is None else f"restored {unit}[expert {e}] {q}"
            out.append((label, restore.identify(slot, q, t, want[unit][q], fresh[name][q])))
    return out


def run(ctx, row: Row, opts) -> list:
    """Every rank: train, save its state dicts, continue (uninterrupted) | a fresh layer loads them, continue."""
    moe_layer_cls, gate_cls = fs.layer_classes()
    import torch.distributed as dist

    from moebench.libraries.resume import restore_comparisons, shared_dir
    from moebench.parity.compare import EXACT, compare

    r, w, seed = ctx.rank, ctx.world_size, opts.seed
    later = range(SAVE_STEPS, SAVE_STEPS + CONTINUE_STEPS)
    layer = _layer(seed, r, w, moe_layer_cls, gate_cls)
    opt = torch.optim.Adam(layer.parameters(), lr=ADAM_LR)
    _steps(layer, opt, seed, range(SAVE_STEPS), r, w)
    with shared_dir("fairscale-resume") as folder:
        torch.save({"model": layer.state_dict(), "optimizer": opt.state_dict()}, folder / f"rank{r}.pt")
        dist.barrier()  # every rank's file is written
        everyone: list = [None] * w
        dist.all_gather_object(everyone, _state(layer, opt))
        ref_losses = _steps(layer, opt, seed, later, r, w)
        ref_final = {name: p.detach().clone() for name, p in layer.named_parameters()}

        resumed = _layer(seed + FRESH_SEED_OFFSET, r, w, moe_layer_cls, gate_cls)
        resumed_opt = torch.optim.Adam(resumed.parameters(), lr=ADAM_LR)
        fresh = _state(resumed, resumed_opt)
        checkpoint = torch.load(folder / f"rank{r}.pt", weights_only=True)
        resumed.load_state_dict(checkpoint["model"])
        resumed_opt.load_state_dict(checkpoint["optimizer"])
    out = restore_comparisons(_findings(_state(resumed, resumed_opt), fresh, everyone, r), r)
    losses = _steps(resumed, resumed_opt, seed, later, r, w)
    for step, got, expected in zip(later, losses, ref_losses):
        out.append(compare(f"loss at step {step + 1} (resumed vs uninterrupted)", torch.tensor(got),
                           torch.tensor(expected), EXACT, rank=r, group=OUTPUT))
    layout = ExpertLayout(PER_RANK * w, w)
    for name, p in resumed.named_parameters():
        unit, _, e = _unit(name, layout, r)
        label = unit if e is None else f"{unit}[expert {e}]"
        out.append(compare(f"{label} after {CONTINUE_STEPS} resumed Adam steps", p.detach(), ref_final[name], EXACT,
                           rank=r, group=fs.param_group(name) if e is None else EXPERTS))
    return out
