"""Standalone reproduction: fairscale's MOELayer + Top2Gate over W gloo ranks on CPU (experts spread over
the ranks, each rank its own tokens), against the same mathematics on one process.

Needs only Python, torch and fairscale. Run: `python THIS_FILE` (option: --deadline SECONDS).
Exit status: 1 the bug shows (the first diverging quantity is printed), 0 it does not, 2 setup error.

Ranks: `MOELayer(Top2Gate(d, E), ModuleList(this rank's experts))` over the default group, as fairscale's
users write it. fairscale leaves gradient synchronisation to the user and marks expert parameters
`p.expert = True`: unmarked parameters are averaged over the ranks (DDP's convention); marked ones already
hold the sum over every rank's tokens (the backward all-to-all brought it) and are divided by W.
Reference: plain math on one process, written independently of fairscale: softmax gate, top-1 by argmax,
top-2 by argmax over the logits plus the same Gumbel noise (same seed), GShard's capacity 2S/E with
first-come slots, kept gates renormalised. fairscale's capacity is PER RANK (S is the rank's token count),
so the reference gates each rank's tokens separately and averages the ranks' losses.
Compared at every SGD step, in this order: each rank's output, its loss, every gradient (the input's,
the gate's, each expert's by its global index) and every parameter after the step.
"""

# ruff: noqa: F405
import math
import os
import sys
import zlib

from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)

SETTINGS = json.loads('{"experts_per_rank": 1, "world_size": 2}')  # @SETTINGS@ (filled by moebench)

D_MODEL = 8
D_HIDDEN = 16
TOKENS_PER_EXPERT = 4  # tokens per rank = 4 x E: top2gating needs S % E == 0; capacity 2S/E = 8 slots
LR = 0.5
TOKEN_SCALE = 4.0  # a token steered along gate row e picks expert e first
KINDS = ("output", "loss", "gradient", "parameter after the step")


def experts():
    return SETTINGS.get("experts_per_rank", 1) * SETTINGS["world_size"]


def initial(name, shape):
    """A parameter's initial value from a generator keyed by its global name (the same on every side)."""
    import torch

    gen = torch.Generator().manual_seed(SETTINGS.get("seed", 0) * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[-1] if len(shape) > 1 else D_MODEL)
    value = torch.rand(shape, generator=gen) * 2 * bound - bound
    if name == "gate.wg.weight":  # equal-norm rows: a token c * row_e picks expert e first
        value = value / value.norm(dim=1, keepdim=True)
    return value


def global_name(name, rank):
    """MOELayer's "experts.<i>.rest" on `rank` -> "experts.<global>.rest"; others as they are."""
    if not name.startswith("experts."):
        return name
    _, i, rest = name.split(".", 2)
    return f"experts.{rank * SETTINGS.get('experts_per_rank', 1) + int(i)}.{rest}"


def group_of(name):
    return "expert" if name.startswith("experts.") else "gate" if name.startswith("gate.") else "input"


def data(step):
    """Every rank's tokens and loss weights of step `step`; each expert gets a steered token per rank."""
    import torch

    e, w = experts(), SETTINGS["world_size"]
    tokens = TOKENS_PER_EXPERT * e
    g = torch.Generator().manual_seed(SETTINGS.get("seed", 0) * 1000 + step)
    x_all = torch.randn(w, tokens, D_MODEL, generator=g)
    weights = torch.randn(w, tokens, D_MODEL, generator=g)
    return x_all, weights


def steer(x_all, gate_weight):
    rows = gate_weight.detach()
    for e in range(experts()):
        x_all[:, e] = TOKEN_SCALE * rows[e] / rows[e].norm()
    return x_all


def noise_seed(step, rank):
    return SETTINGS.get("seed", 0) * 10_000 + step * 100 + rank


def reference_layer(params, x, noise):
    """GShard top-2 on ONE rank's tokens x[S, d] as plain math (capacity 2S/E per expert)."""
    import torch
    import torch.nn.functional as F

    s, e_count = x.shape[0], experts()
    capacity = 2 * s // e_count
    logits = F.linear(x, params["gate.wg.weight"])
    gates = logits.softmax(dim=1)
    first = gates.argmax(dim=1)
    second = (logits + noise).scatter(1, first[:, None], float("-inf")).argmax(dim=1)
    same1 = first[:, None] == first[None, :]
    same2 = second[:, None] == second[None, :]
    earlier = torch.ones(s, s, dtype=torch.bool).tril(-1)
    pos1 = (same1 & earlier).sum(1)  # slot in the expert's queue: earlier tokens of the same expert,
    pos2 = (same2 & earlier).sum(1) + torch.bincount(first, minlength=e_count)[second]  # seconds behind firsts
    g1 = gates.gather(1, first[:, None])[:, 0] * (pos1 < capacity)
    g2 = gates.gather(1, second[:, None])[:, 0] * (pos2 < capacity)
    denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    outs = []
    for e in range(e_count):
        h = F.gelu(F.linear(x, params[f"experts.{e}.fc1.weight"], params[f"experts.{e}.fc1.bias"]))
        outs.append(F.linear(h, params[f"experts.{e}.fc2.weight"], params[f"experts.{e}.fc2.bias"]))
    every = torch.stack(outs, dim=1)
    rows = torch.arange(s)
    return (g1 / denom)[:, None] * every[rows, first] + (g2 / denom)[:, None] * every[rows, second]


def library_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: fairscale's layer as its users run it; records what it did."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from fairscale.nn.moe import MOELayer, Top2Gate
        from torch import nn

        gloo(rank, world, store_path, deadline)

        class FFN(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(D_MODEL, D_HIDDEN)
                self.fc2 = nn.Linear(D_HIDDEN, D_MODEL)

            def forward(self, x):
                return self.fc2(F.gelu(self.fc1(x)))

        per_rank = SETTINGS.get("experts_per_rank", 1)
        layer = MOELayer(Top2Gate(D_MODEL, experts()), nn.ModuleList(FFN() for _ in range(per_rank)))
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(initial(global_name(name, rank), tuple(p.shape)))
        records = []
        phase = TRAINING
        for step in range(SETTINGS.get("steps", 3)):
            x_all, weights = data(step)
            x = steer(x_all, layer.gate.wg.weight)[rank].clone().requires_grad_(True)
            tokens = x.shape[0]
            torch.manual_seed(noise_seed(step, rank))  # top2gating draws its Gumbel noise here
            y = layer(x.view(2, tokens // 2, D_MODEL)).reshape(tokens, D_MODEL)
            loss = (y * weights[rank]).mean()
            loss.backward()
            for p in layer.parameters():  # the user's data-parallel wrapper (fairscale has none)
                if p.grad is None:
                    continue
                if not getattr(p, "expert", False):
                    dist.all_reduce(p.grad)
                p.grad.div_(world)
            records.append((step, 0, f"output (rank {rank})", "output", y.detach().double()))
            records.append((step, 1, f"loss (rank {rank})", "loss", loss.detach().double().reshape(1)))
            records.append((step, 2, f"input gradient (rank {rank})", "input", x.grad.double()))
            for name, p in layer.named_parameters():
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                gname = global_name(name, rank)
                records.append((step, 2, f"{gname} gradient", group_of(gname), got.detach().double()))
            with torch.no_grad():
                for name, p in layer.named_parameters():
                    if p.grad is not None:
                        p -= LR * p.grad
                    p.grad = None
                    gname = global_name(name, rank)
                    records.append((step, 3, f"{gname} after the step", group_of(gname), p.detach().double().clone()))
        save(out, rank, {"records": records})
        phase = "teardown"
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def reference_rank(world, store_path, out, deadline):
    """The reference: one process, plain math, each rank's tokens gated as that rank gates them."""
    phase = SETUP
    try:
        watchdog(deadline)
        import torch

        names = ["gate.wg.weight"] + [f"experts.{e}.{n}" for e in range(experts())
                                      for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
        shapes = {"fc1.weight": (D_HIDDEN, D_MODEL), "fc1.bias": (D_HIDDEN,), "fc2.weight": (D_MODEL, D_HIDDEN),
                  "fc2.bias": (D_MODEL,)}
        params = {n: initial(n, (experts(), D_MODEL) if n == "gate.wg.weight" else shapes[n.split(".", 2)[2]])
                  .requires_grad_(True) for n in names}
        records = []
        phase = TRAINING
        for step in range(SETTINGS.get("steps", 3)):
            x_all, weights = data(step)
            x_all = steer(x_all, params["gate.wg.weight"]).requires_grad_(True)
            tokens = x_all.shape[1]
            noise = []
            for rank in range(world):
                torch.manual_seed(noise_seed(step, rank))
                noise.append(torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0))
                             .rsample((tokens, experts())))
            ys = [reference_layer(params, x_all[r], noise[r]) for r in range(world)]
            losses = [(ys[r] * weights[r]).mean() for r in range(world)]
            torch.stack(losses).mean().backward()  # the one-process objective: the mean over every rank's tokens
            for r in range(world):
                records.append((step, 0, f"output (rank {r})", "output", ys[r].detach().double()))
                records.append((step, 1, f"loss (rank {r})", "loss", losses[r].detach().double().reshape(1)))
                records.append((step, 2, f"input gradient (rank {r})", "input", x_all.grad[r].double() * world))
            for n, p in params.items():
                records.append((step, 2, f"{n} gradient", group_of(n), p.grad.detach().double().clone()))
            with torch.no_grad():
                for n, p in params.items():
                    p -= LR * p.grad
                    p.grad = None
                    records.append((step, 3, f"{n} after the step", group_of(n), p.detach().double().clone()))
        save(out, "reference", {"records": records})
    except BaseException:  # noqa: BLE001
        fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def describe():
    import fairscale

    return (f"fairscale {fairscale.__version__} MOELayer + Top2Gate, {SETTINGS['world_size']} gloo ranks, "
            f"{SETTINGS.get('experts_per_rank', 1)} expert(s) per rank, {SETTINGS.get('steps', 3)} SGD steps")


mechanism = layer_mechanism("the gate, the capacity or the all-to-all exchange",
                            "the backward all-to-all or the gradient synchronisation")


if __name__ == "__main__":
    sys.exit(main(world=int(SETTINGS["world_size"]), library_rank=library_rank, reference_rank=reference_rank,
                  describe=describe, kinds=KINDS, where="", mechanism=mechanism))
