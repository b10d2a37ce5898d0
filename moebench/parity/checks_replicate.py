"""Checks 3-6, composable `replicate` (seed 001 test_replicate.py).

3 `replicate-state-dict`: whole-model and per-submodule replicate(); keys and values equal rank
  0's local module's state_dict. Each rank initialises with seed + rank and runs one forward
  (replicate builds its DDP - which broadcasts rank 0's state - lazily, at the first forward), so
  the values agree only if the broadcast happened.
4 `replicate-train`: seed 001's `_compare_module` training parity for the whole model, for each
  submodule replicated separately, and with bucket_cap_mb=1, gradient_as_bucket_view=True.
5 `replicate-ignored`: ignored_modules=[fc1]: fc1's gradients differ across ranks, fc2's and
  fc3's are equal (the seed runs it on GPUs only; here on CPU too).
6 `replicate-bad-device-id`: a list device_id raises RuntimeError "Expected device_id to be int or
  torch.device".
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from moebench.parity.checks_ddp import Net, sgd_compare
from moebench.parity.compare import EXACT, SEED_STATE_DICT, assertion, compare, pick
from moebench.parity.registry import Check, CheckOptions, impl_or_default, register

BAD_DEVICE_ID_MESSAGE = "Expected device_id to be int or torch.device"


def _torch_replicate():
    from torch.distributed._composable.replicate import replicate

    return replicate


def _impl(opts):
    return impl_or_default(opts, "replicate", _torch_replicate())


def _state_dict_parity(prefix, local_sd, other_sd, tol, asserted, rank) -> list:
    results = [assertion(f"{prefix}: keys", list(local_sd) == list(other_sd), rank=rank,
                         note="" if list(local_sd) == list(other_sd)
                         else f"local {list(local_sd)} vs replicated {list(other_sd)}")]
    for key, value in local_sd.items():
        if key in other_sd:
            results.append(compare(f"{prefix}: {key}", other_sd[key], value, tol, asserted=asserted, rank=rank))
    return results


def _rank_state_dict(ctx, opts: CheckOptions) -> list:
    replicate, label = _impl(opts)
    tol, asserted = pick(opts.tolerance, strict=EXACT, seed=SEED_STATE_DICT)
    torch.manual_seed(opts.seed)
    model = Net()  # rank 0's initial state, rebuilt on every rank
    torch.manual_seed(opts.seed + ctx.rank)
    mine = Net()  # this rank's own initial state: differs from rank 0's on every other rank
    probe = torch.randn(3, 2, generator=torch.Generator().manual_seed(opts.seed))
    whole = replicate(copy.deepcopy(mine))
    whole(probe)
    results = _state_dict_parity("whole model", model.state_dict(), whole.state_dict(), tol, asserted, ctx.rank)
    parts = copy.deepcopy(mine)
    for sub in (parts.fc1, parts.fc2, parts.fc3):
        replicate(sub)
    parts(probe)
    results += _state_dict_parity("each submodule", model.state_dict(), parts.state_dict(), tol, asserted, ctx.rank)
    results[0].note = (results[0].note + f" impl {label}").strip()
    return results


def _rank_train(ctx, opts: CheckOptions) -> list:
    replicate, label = _impl(opts)
    torch.manual_seed(opts.seed)
    model = Net()
    results = sgd_compare(ctx, opts, copy.deepcopy(model), replicate(copy.deepcopy(model)), "whole model", label)
    parts = copy.deepcopy(model)
    for sub in (parts.fc1, parts.fc2, parts.fc3):
        replicate(sub)
    results += sgd_compare(ctx, opts, copy.deepcopy(model), parts, "each submodule", label)
    bucketed = replicate(copy.deepcopy(model), bucket_cap_mb=1, gradient_as_bucket_view=True)
    results += sgd_compare(ctx, opts, copy.deepcopy(model), bucketed,
                           "bucket_cap_mb=1, gradient_as_bucket_view=True", label)
    return results


def _rank_ignored(ctx, opts: CheckOptions) -> list:
    replicate, label = _impl(opts)
    # Same model on every rank, different data per rank: local gradients differ.
    torch.manual_seed(opts.seed)
    model = Net()
    replicate(model, ignored_modules=[model.fc1])
    g = torch.Generator().manual_seed(opts.seed * 100 + ctx.rank)
    inp = torch.randn(5, 2, generator=g) * (ctx.rank + 1)
    (model(inp) * 10).sum().backward()
    results = []
    for name, grad, must_differ in (("fc1.weight", model.fc1.weight.grad, True),
                                    ("fc2.weight", model.fc2.weight.grad, False),
                                    ("fc3.weight", model.fc3.weight.grad, False)):
        grads = [torch.zeros_like(grad) for _ in range(ctx.world_size)]
        dist.all_gather(grads, grad.contiguous())
        for other in range(1, ctx.world_size):
            if ctx.rank != 0:
                continue
            verb = "differs from" if must_differ else "equals"
            # Seed 001 uses assertNotEqual / assertEqual (exact for "equal" after an all-reduce).
            tol, _ = pick(opts.tolerance, strict=EXACT, seed=EXACT)
            results.append(compare(f"{name} grad on rank {other} {verb} rank 0's", grads[other], grads[0], tol,
                                   expect_equal=not must_differ, note=f"impl {label}"))
    return results


def _rank_bad_device_id(ctx, opts: CheckOptions) -> list:
    replicate, label = _impl(opts)
    try:
        replicate(Net(), device_id=[torch.device("cpu")])
    except RuntimeError as exc:
        ok = BAD_DEVICE_ID_MESSAGE in str(exc)
        return [assertion("device_id=[cpu] raises RuntimeError with the documented message", ok,
                          kind="raises", note=f"impl {label}: {exc}")]
    except Exception as exc:  # noqa: BLE001 - the wrong exception type is a failure, not a crash
        return [assertion("device_id=[cpu] raises RuntimeError", False, kind="raises",
                          note=f"impl {label} raised {type(exc).__name__}: {exc}")]
    return [assertion("device_id=[cpu] raises RuntimeError", False, kind="raises",
                      note=f"impl {label} accepted a list device_id silently")]


register(Check(
    name="replicate-state-dict", order=30, seed_source="001 test_replicate",
    description="replicate() whole model and per submodule: state_dict keys and values equal the local module's",
    catches="a replicate() that renames state_dict keys (e.g. adds a prefix) or never broadcasts rank 0's weights",
    preload=("torch._dynamo",), rank_fn=_rank_state_dict, impl_keys=("replicate",),
))
register(Check(
    name="replicate-train", order=40, seed_source="001 test_replicate",
    description="replicate() training parity: whole model, each submodule, bucket_cap_mb=1 + gradient_as_bucket_view",
    catches="a replicate() whose gradient averaging is missing or mis-scaled: whole model, per submodule "
            "or small buckets",
    preload=("torch._dynamo",), rank_fn=_rank_train, impl_keys=("replicate",),
))
register(Check(
    name="replicate-ignored", order=50, seed_source="001 test_replicate",
    description="ignored_modules=[fc1]: fc1 grads differ across ranks, fc2/fc3 grads equal",
    catches="a replicate() that still syncs the gradients of ignored_modules, or leaves the other modules' unsynced",
    preload=("torch._dynamo",), rank_fn=_rank_ignored, impl_keys=("replicate",), min_world_size=2,
))
register(Check(
    name="replicate-bad-device-id", order=60, seed_source="001 test_replicate",
    description='a list device_id raises RuntimeError "Expected device_id to be int or torch.device"',
    catches="a replicate() that silently accepts a list device_id, or rejects it with another error or message",
    preload=("torch._dynamo",), rank_fn=_rank_bad_device_id, impl_keys=("replicate",),
))
