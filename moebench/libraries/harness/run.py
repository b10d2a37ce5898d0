"""What every rank of a Layer's row runs: the layer over the ranks against the one-process layer.

Seeds, data and loss are moebench's: every parameter drawn from (seed, its global unit) (units.py), so a rank's
expert and the one-process layer's same expert start equal; a global batch of W x tokens_per_rank tokens from
(seed, step), rank r its r-th slice; the loss a rank minimises is the mean over its tokens of <y, target>, the
reference's the mean over every token (so the global objective is the mean of the ranks' losses; a rank's input
gradient is W x the reference's). The loss is linear in the output, so a known-wrong reference (known.py) that
changes the forward still gives the backward that implementation would give.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from moebench.libraries.harness.common import SYNC_NONE, SYNC_STANDARD, loss_of, output_of
from moebench.libraries.harness.known import answers, per_rank_clip
from moebench.libraries.harness.units import by_unit, describe, expert_unit, global_map, layout_problem, units
from moebench.parity.compare import EXACT, SEED_ALLCLOSE_DEFAULT, STRICT, Comparison, compare, pick
from moebench.parity.diagnose import router_detached
from moebench.parity.diagnosis import EXPERTS, INPUT_GRAD, OUTPUT, REPLICATED, ROUTER
from moebench.parity.raised import AdapterProtocolError

LR = {"sgd": 0.2, "adam": 0.01}
"""Step sizes: large enough that a wrong gradient moves the weights visibly in two steps, small enough that the
layer stays in its regime (routing does not collapse)."""
CLIP_FRACTION = 0.5
"""A clip row's max_norm: this fraction of the reference's gradient norm at the first step, so the clip binds."""
FRESH_SEED_OFFSET = 7919
"""A resume row's fresh layer is drawn from seed + this (a prime), so that nothing it holds equals the trained one."""


def _draw(seed: int, key: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    fan_in = shape[-1] if len(shape) >= 2 else 0
    scale = fan_in ** -0.5 if fan_in else 0.1
    return torch.randn(shape, generator=g) * scale


def seed_weights(spec, layer: torch.nn.Module, to_global, seed: int) -> None:
    """Every parameter from (seed, its unit): an expert's from its global index, whichever rank holds it."""
    with torch.no_grad():
        for unit, _, t in units(spec, layer, to_global):
            key = f"expert {unit[0]}/{unit[1]}" if expert_unit(unit) else unit
            t.copy_(_draw(seed, key, t.shape))


def batch(seed: int, step: int, world: int, tokens: int, d_model: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(world, tokens, d_model, generator=g), torch.randn(world, tokens, d_model, generator=g)


def optimizer(name: str, params) -> torch.optim.Optimizer:
    params = list(params)
    if name == "adam":
        return torch.optim.Adam(params, lr=LR["adam"], foreach=False)
    return torch.optim.SGD(params, lr=LR["sgd"], foreach=False)


def sync(spec, layer, world: int) -> None:
    """The layer's gradient sync: its own, or moebench's standard (harness.SYNC_STANDARD)."""
    if callable(spec.sync):
        spec.sync(layer)
        return
    if spec.sync == SYNC_NONE:
        return
    assert spec.sync == SYNC_STANDARD
    experts = {id(t) for u, _, t in units(spec, layer, lambda s: s) if expert_unit(u)}
    stacked = set(spec.experts) if not isinstance(spec.experts, str) else set()
    for name, p in layer.named_parameters():
        if p.grad is None:
            continue
        if id(p) in experts or name in stacked:
            p.grad /= world
        else:
            dist.all_reduce(p.grad)
            p.grad /= world


def build_pair(spec, ctx, k: int, seed: int):
    """(layer on this rank, its slot -> global map, one-process layer, E)."""
    world, rank = ctx.world_size, ctx.rank
    experts = k * world
    problem = layout_problem(spec, world, experts)
    if problem:
        raise AdapterProtocolError(problem)
    to_global = global_map(spec, rank, world, experts)
    mine, whole = spec.build(rank, world, experts), spec.build(0, 1, experts)
    for what, layer in (("build(rank, world_size, experts)", mine), ("build(0, 1, experts)", whole)):
        if not isinstance(layer, torch.nn.Module):
            raise AdapterProtocolError(f"{what} returned a {type(layer).__name__}; it must return a torch.nn.Module")
    held = [u for u, _, _ in units(spec, mine, to_global)]
    everything = set(u for u, _, _ in units(spec, whole, lambda s: s))
    missing = [describe(u) for u in held if u not in everything]
    if missing:
        raise AdapterProtocolError(f"the layer for rank {rank} of {world} has parameters the one-process layer "
                                   f"lacks: {', '.join(missing[:4])} (is `experts` / `layout` right?)")
    if not any(expert_unit(u) for u in held):
        raise AdapterProtocolError(f"no parameter of the layer is an expert's by experts={spec.experts!r}")
    seed_weights(spec, mine, to_global, seed)
    seed_weights(spec, whole, lambda s: s, seed)
    return mine, to_global, whole, experts


def _clip_alt(alternatives: dict, unit) -> dict:
    return {"per-rank clip norm": alternatives[unit]} if unit in alternatives else {}


def dense_group(name: str) -> str:
    """A non-expert parameter's group: the router's (gate, router, gating) or the rest (replicated)."""
    import re

    return ROUTER if re.search(r"router|gate|gating|score", name, re.I) else REPLICATED


def _tol(opts):
    return pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)


def parity(spec, ctx, row, opts) -> list[Comparison]:
    """Every rank: the layer over the ranks vs the one-process layer, `steps` steps of the row's optimizer."""
    tol, asserted = _tol(opts)
    r, w = ctx.rank, ctx.world_size
    s = row.settings
    mine, to_global, whole, experts = build_pair(spec, ctx, s.experts_per_rank, opts.seed)
    opt, ref_opt = optimizer(s.optimizer, mine.parameters()), optimizer(s.optimizer, whole.parameters())
    tokens = slice(r * s.tokens_per_rank, (r + 1) * s.tokens_per_rank)
    out: list[Comparison] = []
    max_norm = None

    def cmp(name, actual, expected, group, **kw):
        c = compare(name, actual, expected, tol, rank=r, asserted=asserted, world_size=w, group=group, **kw)
        out.append(c)
        return c

    for step in range(s.steps):
        tag = f"step {step + 1}"
        x_all, t_all = batch(opts.seed, step, w, s.tokens_per_rank, spec.d_model)
        wrong = answers(spec, whole, r, w, experts, x_all, t_all)
        x = x_all[r].clone().requires_grad_(True)
        y = output_of(mine(x))
        loss_of(y, t_all[r]).backward()
        sync(spec, mine, w)
        big = x_all.reshape(-1, spec.d_model).clone().requires_grad_(True)
        y_ref = output_of(whole(big))
        loss_of(y_ref, t_all.reshape(-1, spec.d_model)).backward()
        if s.clip:
            if max_norm is None:  # decided once, from the reference: the same number on every rank
                max_norm = CLIP_FRACTION * float(torch.nn.utils.get_total_norm(
                    [p.grad for p in whole.parameters() if p.grad is not None]))
            spec.clip(mine, max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm)
            clipped_alt = per_rank_clip(spec, by_unit(spec, whole, lambda i: i, grads=True), r, w, experts,
                                              max_norm, float(ref_norm))
        else:
            clipped_alt = {}
        output = cmp(f"{tag}: output", y.detach(), y_ref.detach()[tokens], OUTPUT,
                     alternatives=wrong.output(r))
        grads = by_unit(spec, mine, to_global, grads=True)
        ref_grads = by_unit(spec, whole, lambda i: i, grads=True)
        ref_weights = by_unit(spec, whole, lambda i: i)
        router_cmps = []
        for unit, g in grads.items():
            expected = torch.zeros_like(ref_weights[unit]) if ref_grads[unit] is None else ref_grads[unit]
            got = torch.zeros_like(expected) if g is None else g  # a parameter no gradient reached: all zeros
            if expert_unit(unit):
                cmp(f"{tag}: grad {describe(unit)}", got, expected, EXPERTS,
                    alternatives={**wrong.expert_grad(unit), **_clip_alt(clipped_alt, unit)})
            else:
                router_cmps.append(cmp(f"{tag}: grad {unit}", got, expected, dense_group(unit),
                                       alternatives={**wrong.router_grad(unit), **_clip_alt(clipped_alt, unit)}))
        if output.passed:  # a router gradient of exactly zero under a right output: routing weights detached
            for c in router_cmps:
                if c.group == ROUTER:
                    router_detached(c)
        cmp(f"{tag}: input grad", x.grad if x.grad is not None else torch.zeros_like(x), big.grad[tokens] * w,
            INPUT_GRAD, alternatives=wrong.input_grad(r))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        after = by_unit(spec, whole, lambda i: i)
        for unit, t in by_unit(spec, mine, to_global).items():
            group = EXPERTS if expert_unit(unit) else dense_group(unit)
            cmp(f"{tag}: {describe(unit)} after the {s.optimizer} step", t.detach(), after[unit].detach(), group)
    return out


# ---------------------------------------------------------------- save -> load -> continue

def resume(spec, ctx, row, opts) -> list[Comparison]:
    """The layer's own state dict round trip, checked exactly (whether the steps before it match one process is the
    parity rows' question): train `steps` steps, save the layer's and the optimizer's state dicts (each rank its own),
    then either load them into a fresh layer built from another seed at the same world size (every slot matched
    against every global expert, weights and Adam moments, then `steps` more steps bit for bit with the run that
    never stopped), or consolidate every rank's into the one-process layer through its own load_state_dict (every
    expert by global index, bit for bit with the ranks' weights)."""
    from moebench.libraries.resume import restore_comparisons, shared_dir

    r, w = ctx.rank, ctx.world_size
    s = row.settings
    mine, to_global, _, experts = build_pair(spec, ctx, s.experts_per_rank, opts.seed)
    opt = optimizer(s.optimizer, mine.parameters())

    def train(step: int, layers: list) -> None:
        x_all, t_all = batch(opts.seed, step, w, s.tokens_per_rank, spec.d_model)
        for layer, optim in layers:
            loss_of(output_of(layer(x_all[r].clone())), t_all[r]).backward()
            sync(spec, layer, w)
            optim.step()
            optim.zero_grad(set_to_none=True)

    for step in range(s.steps):
        train(step, [(mine, opt)])
    with shared_dir("layer-resume") as folder:
        torch.save({"layer": mine.state_dict(), "optimizer": opt.state_dict()}, folder / f"rank{r}.pt")
        dist.barrier()
        if getattr(s, "load_ep_size", None) == 1:
            return _to_one_process(spec, r, w, experts, folder, mine, to_global, opts)
        fresh = spec.build(r, w, experts)
        seed_weights(spec, fresh, to_global, opts.seed + FRESH_SEED_OFFSET)
        fresh_units = {u: t.detach().clone() for u, t in by_unit(spec, fresh, to_global).items()}
        fresh_opt = optimizer(s.optimizer, fresh.parameters())
        saved = torch.load(folder / f"rank{r}.pt", weights_only=False)
        fresh.load_state_dict(saved["layer"])
        fresh_opt.load_state_dict(saved["optimizer"])
    # right after the load: which expert's weights and moments every slot holds, matched against every expert's
    out = restore_comparisons(_slot_findings(spec, r, mine, opt, fresh, fresh_opt, to_global, fresh_units), r)
    for step in range(s.steps, 2 * s.steps):
        train(step, [(mine, opt), (fresh, fresh_opt)])
        kept = by_unit(spec, mine, to_global)
        for unit, t in by_unit(spec, fresh, to_global).items():
            out.append(compare(f"step {step + 1} (resumed): {describe(unit)} vs the run that never stopped",
                               t.detach(), kept[unit].detach(), EXACT, rank=r,
                               group=EXPERTS if expert_unit(unit) else dense_group(unit)))
    return out


def _moments(spec, layer, optim, to_global) -> dict[str, dict]:
    """{"exp_avg": {unit: tensor}, "exp_avg_sq": ...} of an Adam optimizer over `layer` (empty for SGD)."""
    out: dict[str, dict] = {}
    for name, p in layer.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            moment = optim.state.get(p, {}).get(key)
            if moment is not None:
                out.setdefault(key, {}).update(_units_of_tensor(spec, name, moment.detach().clone(), to_global))
    return out


def _units_of_tensor(spec, name: str, tensor: torch.Tensor, to_global) -> dict:
    """A tensor shaped as parameter `name`, cut into its units."""
    if isinstance(spec.experts, str):
        prefix = spec.experts + "."
        if name.startswith(prefix) and name[len(prefix):].split(".", 1)[0].isdigit():
            slot_text, rest = name[len(prefix):].split(".", 1)
            return {(to_global(int(slot_text)), rest): tensor}
        return {name: tensor}
    if name in spec.experts:
        dim = spec.experts[name]
        return {(to_global(slot), name): tensor.select(dim, slot) for slot in range(tensor.shape[dim])}
    return {name: tensor}


def _slot_findings(spec, r, mine, opt, fresh, fresh_opt, to_global, fresh_units) -> list:
    """(comparison name, Finding) for every unit of this rank after the load: which expert's weights (and Adam
    moments) it holds, against every global expert's in the run that never stopped (gathered from every rank)."""
    from moebench.parity import restore

    everyone: list = [None] * dist.get_world_size()
    kept = {"weights": {u: t.detach().clone() for u, t in by_unit(spec, mine, to_global).items()},
            **_moments(spec, mine, opt, to_global)}
    dist.all_gather_object(everyone, kept)
    got = {"weights": by_unit(spec, fresh, to_global), **_moments(spec, fresh, fresh_opt, to_global)}
    slots = {u: slot for u, slot, _ in units(spec, fresh, to_global)}
    quantity = {"weights": restore.WEIGHTS, "exp_avg": restore.EXP_AVG, "exp_avg_sq": restore.EXP_AVG_SQ}
    findings = []
    for key, held in got.items():
        for unit, t in held.items():
            if expert_unit(unit):  # every global expert of this parameter is a candidate
                want = {u[0]: v for each in everyone for u, v in each.get(key, {}).items()
                        if expert_unit(u) and u[1] == unit[1]}
                slot = restore.Slot(rank=r, local=slots[unit], unit=unit[0])
            else:
                want = {unit: everyone[r][key][unit]}
                slot = restore.Slot(rank=r, local=None, unit=unit)
            fresh_t = fresh_units.get(unit) if key == "weights" else None
            f = restore.identify(slot, quantity[key], t.detach(), want, fresh=fresh_t)
            findings.append((f"after the load: {describe(unit)} {key}", f))
    return findings


def _to_one_process(spec, r, w, experts, folder, mine, to_global, opts) -> list[Comparison]:
    """Every rank's checkpoint consolidated, by global expert, into one state dict of the one-process layer's keys,
    loaded through its own load_state_dict (built from another seed first): each of its units must then be,
    bit for bit, what the rank holding that unit has."""
    one = spec.build(0, 1, experts)
    seed_weights(spec, one, lambda i: i, opts.seed + FRESH_SEED_OFFSET)
    merged: dict = {}
    first = None
    for rank in range(w):
        saved = torch.load(folder / f"rank{rank}.pt", weights_only=False)["layer"]
        first = first or saved
        rank_map = global_map(spec, rank, w, experts)
        for name, tensor in saved.items():
            merged.update(_units_of_tensor(spec, name, tensor, rank_map))
    state = {}
    for name, tensor in one.state_dict().items():
        parts = _units_of_tensor(spec, name, tensor, lambda i: i)
        if len(parts) == 1 and not expert_unit(next(iter(parts))):
            state[name] = merged.get(name, first.get(name, tensor))  # a buffer: rank 0's (replicated)
        elif not isinstance(spec.experts, str) and name in spec.experts:
            state[name] = torch.stack([merged[u] for u in parts], dim=spec.experts[name])
        else:
            state[name] = merged[next(iter(parts))]
    one.load_state_dict(state)
    everyone: list = [None] * w
    dist.all_gather_object(everyone, {u: t.detach().clone() for u, t in by_unit(spec, mine, to_global).items()})
    held = {u: t for each in everyone for u, t in each.items()}
    return [compare(f"one process from every rank's checkpoint: {describe(unit)}", t.detach(), held[unit], EXACT,
                    rank=r, group=EXPERTS if expert_unit(unit) else dense_group(unit))
            for unit, t in by_unit(spec, one, lambda i: i).items()]
