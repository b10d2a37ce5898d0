"""Standalone reproduction: a Hugging Face transformers MoE block under transformers' own expert parallelism
(`from_pretrained(..., distributed_config=DistributedConfig(...))`) over W gloo ranks on CPU, against the same
block loaded on one process.

Needs only Python, torch, transformers (and accelerate, which its distributed loading needs). Run:
`python THIS_FILE` (option: --deadline SECONDS). Exit status: 1 the bug shows (the first diverging quantity is
printed), 0 it does not, 2 setup error.

Model: a one-layer `<Family>ForCausalLM` from a tiny config (nothing downloaded), random weights generated the
same way in every process. Its MoE block (`model.layers.0.mlp`) is driven directly on both sides.
Ranks: the model loaded with the DistributedConfig below; in the data-parallel all-to-all layout each rank
holds its part of the batch, otherwise every rank holds the whole batch.
Reference: the same model loaded without a DistributedConfig on one process, the whole global batch; the loss
is the mean over every token. Plain SGD on both sides.
Compared at every step, in this order: each rank's output, its loss, every gradient (each expert by its
GLOBAL index and transformers' own parameter name, the others whole, then the input's) and every parameter
after the step.
"""

# ruff: noqa: F405
import os
import sys

from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)

SETTINGS = json.loads('{"world_size": 2}')  # @SETTINGS@ (filled by moebench)

KINDS = ("output", "loss", "gradient", "parameter after the step")


def quiet():
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.simplefilter("ignore")


def classes():
    import transformers as hf

    return getattr(hf, SETTINGS["config_class"])(**SETTINGS["config"]), getattr(hf, SETTINGS["model_class"])


def state_dict(model_cls, config):
    """Random weights, N(0, 1/fan_in), the same in every process (seeded; no broadcast needed)."""
    import torch

    seed = SETTINGS.get("seed", 0)
    torch.manual_seed(seed)
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed * 7919 + 3)
    state = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            scale = 0.1 if name.endswith("e_score_correction_bias") else t.shape[-1] ** -0.5
            t = torch.randn(t.shape, generator=g, dtype=t.dtype) * scale
        state[name] = t.contiguous().clone()
    return state


def load(model_cls, config, state, distributed_config=None):
    extra = {} if distributed_config is None else {"distributed_config": distributed_config}
    model = model_cls.from_pretrained(None, config=config, state_dict={n: t.clone() for n, t in state.items()},
                                      experts_implementation=SETTINGS["backend"], **extra)
    model.train()
    return model.get_submodule(SETTINGS["block"])


def batch(step):
    """The global batch of one step (inputs, and the targets the loss projects the output on)."""
    import torch

    g = torch.Generator().manual_seed(SETTINGS.get("seed", 0) * 100_003 + step * 101 + 17)
    hidden = SETTINGS["config"]["hidden_size"]
    shape = (SETTINGS["world_size"] * SETTINGS["seqs_per_rank"], SETTINGS["seq_len"], hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def rows_of(rank):
    """The rows of the global batch rank `rank` holds."""
    if SETTINGS["shares_batch"]:
        return slice(None)
    n = SETTINGS["seqs_per_rank"]
    return slice(rank * n, (rank + 1) * n)


def is_expert(name):
    return name.split(".")[0] == "experts"


def group_of(name):
    return "expert" if is_expert(name) else "router" if name.startswith("gate.") else "other"


def library_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: the block loaded with transformers' DistributedConfig; records what it did."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch
        import torch.distributed as dist

        gloo(rank, world, store_path, deadline)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from transformers.distributed import DistributedConfig

        quiet()
        config, model_cls = classes()
        state = state_dict(model_cls, config)
        block = load(model_cls, config, state, DistributedConfig(**SETTINGS["distributed"]))
        prefix = SETTINGS["block"] + "."
        experts = {}
        for name, p in block.named_parameters():
            if is_expert(name):  # each local expert's global index: the reference expert with its weights
                local, whole = local_of(p.detach()), state[prefix + name]
                experts[name] = [next((e for e in range(whole.shape[0]) if torch.equal(local[i], whole[e])), None)
                                 for i in range(local.shape[0])]
        opt = torch.optim.SGD(block.parameters(), lr=SETTINGS["lr"], foreach=False)
        records = []
        phase = TRAINING
        for step in range(SETTINGS["steps"]):
            x_all, t_all = batch(step)
            rows = rows_of(rank)
            x = x_all[rows].clone().requires_grad_(True)
            y = block(x)
            loss = (y * t_all[rows]).sum() / t_all[rows][..., 0].numel()  # the mean over the tokens it holds
            loss.backward()
            records.append((step, 0, f"output (rank {rank})", "output", y.detach().double()))
            records.append((step, 1, f"loss (rank {rank})", "loss", loss.detach().double().reshape(1)))
            for name, p in block.named_parameters():
                if p.grad is None:
                    records.append((step, 2, f"{name} gradient (none reached it)", group_of(name),
                                    torch.full((1,), float("nan"))))
                elif name in experts:
                    grad = local_of(p.grad)
                    for i, e in enumerate(experts[name]):
                        records.append((step, 2, f"{name}[expert {e}] gradient", "expert", grad[i].double()))
                else:
                    records.append((step, 2, f"{name} gradient", group_of(name), full_of(p.grad).double()))
            scale = 1 if SETTINGS["shares_batch"] else world  # its own loss: W x the global mean's
            records.append((step, 2, f"input gradient (rank {rank})", "input", x.grad.double() / scale))
            opt.step()
            opt.zero_grad(set_to_none=True)
            for name, p in block.named_parameters():
                if name in experts:
                    value = local_of(p.detach())
                    for i, e in enumerate(experts[name]):
                        records.append((step, 3, f"{name}[expert {e}] after the step", "expert",
                                        value[i].double().clone()))
                else:
                    records.append((step, 3, f"{name} after the step", group_of(name),
                                    full_of(p.detach()).double().clone()))
        save(out, rank, {"records": records})
        phase = "teardown"
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def full_of(t):
    """A DTensor's whole value (a collective: every rank calls it in the same order); plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


def reference_rank(world, store_path, out, deadline):
    """The reference: the same block without a DistributedConfig, one process, the whole global batch."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch

        quiet()
        config, model_cls = classes()
        block = load(model_cls, config, state_dict(model_cls, config))
        opt = torch.optim.SGD(block.parameters(), lr=SETTINGS["lr"], foreach=False)
        records = []
        phase = TRAINING
        for step in range(SETTINGS["steps"]):
            x_all, t_all = batch(step)
            x = x_all.clone().requires_grad_(True)
            y = block(x)
            ((y * t_all).sum() / t_all[..., 0].numel()).backward()  # the mean over every token
            for r in range(world):
                rows = rows_of(r)
                loss = (y[rows] * t_all[rows]).sum() / t_all[rows][..., 0].numel()
                records.append((step, 0, f"output (rank {r})", "output", y[rows].detach().double()))
                records.append((step, 1, f"loss (rank {r})", "loss", loss.detach().double().reshape(1)))
                records.append((step, 2, f"input gradient (rank {r})", "input", x.grad[rows].double()))
            for name, p in block.named_parameters():
                if is_expert(name):
                    for e in range(p.shape[0]):
                        records.append((step, 2, f"{name}[expert {e}] gradient", "expert", p.grad[e].double()))
                else:
                    records.append((step, 2, f"{name} gradient", group_of(name), p.grad.double()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            for name, p in block.named_parameters():
                if is_expert(name):
                    for e in range(p.shape[0]):
                        records.append((step, 3, f"{name}[expert {e}] after the step", "expert",
                                        p.detach()[e].double().clone()))
                else:
                    records.append((step, 3, f"{name} after the step", group_of(name), p.detach().double().clone()))
        save(out, "reference", {"records": records})
    except BaseException:  # noqa: BLE001
        fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def describe():
    import transformers

    distributed = ", ".join(f"{k}={v!r}" for k, v in SETTINGS["distributed"].items())
    return (f"transformers {transformers.__version__} {SETTINGS['model_class']}, experts_implementation="
            f"{SETTINGS['backend']}, DistributedConfig({distributed}), {SETTINGS['world_size']} gloo ranks, "
            f"{SETTINGS['steps']} SGD steps")


mechanism = layer_mechanism("the router, the dispatch of tokens to experts or the combine",
                            "the backward exchange or the gradient reduction")


if __name__ == "__main__":
    sys.exit(main(world=int(SETTINGS["world_size"]), library_rank=library_rank, reference_rank=reference_rank,
                  describe=describe, kinds=KINDS, where="", mechanism=mechanism))
