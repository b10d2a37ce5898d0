"""transformers resume rows: save under expert parallelism, load into a fresh model at the same and at another
layout, continue; compared slot by slot with the uninterrupted run.

What a row does on every rank, as transformers 5.23 documents it for a model loaded with
`from_pretrained(distributed_config=DistributedConfig(...))`:
1. the row's model family (the adapter's tiny config, seeded weights) under the SAVE layout; SAVE_STEPS steps
   of torch Adam on its MoE block (router, experts, shared experts), driven as the adapter drives it;
2. `model.save_pretrained(dir)` (every rank calls it; transformers gathers the shards, rank 0 writes the
   safetensors; or, `distributed_checkpoint` rows, `save_pretrained(dir, distributed_checkpoint=True)`: every
   rank writes its own shards through torch DCP) and
   `transformers.distributed.save_optimizer_distributed(model, optimizer, dir/optimizer)` (DCP, keyed by
   parameter name so it can be read back at another layout) - transformers' own optimizer path under EP; or,
   `trainer` rows, the optimizer through transformers' Trainer checkpoint code (`Trainer._save_optimizer_and_
   scheduler` / `_load_optimizer_and_scheduler`, what `Trainer.train(resume_from_checkpoint=...)` runs), called
   with the attributes it reads: accelerate refuses to build a Trainer for a TP-style model on CPU ranks
   ("ParallelismConfig is only compatible DistributedType.FSDP ... but got DistributedType.MULTI_CPU");
3. the uninterrupted run: the same model keeps training CONTINUE_STEPS more steps;
4. the resumed run: `from_pretrained(dir, distributed_config=<LOAD layout>)` (or no distributed config at all:
   `ep1`, every rank a whole model) and `load_optimizer_distributed` into a new Adam. The loading model's config
   has `initializer_range=0`: whatever transformers does NOT load keeps its own initialisation, which is then
   zeros (ones for norms) whatever order transformers initialises in - so a slot never restored is recognised
   as such ("fresh"; the same call with an empty state dict gives it);
5. right after the load, per GLOBAL expert and per dense / router parameter, under transformers' own parameter
   names: the weights and Adam's exp_avg, exp_avg_sq and step, each identified (moebench.parity.restore) as
   restored, another expert's, the fresh initialisation, or none of these;
6. CONTINUE_STEPS steps of the resumed run vs the uninterrupted one: the loss at each step and every parameter
   after them - bit for bit at the same layout, within RESUME_OTHER_LAYOUT at another (summation order differs).
The checkpoint lives in a folder every rank sees (moebench.libraries.resume.shared_dir), removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from moebench.libraries.spec import RESUME, Row, Settings
from moebench.libraries.transformers.api import BLOCK, distributed_config, shares_batch
from moebench.libraries.transformers.build import (
    SEQS_PER_RANK,
    batch,
    expert_offset,
    full,
    is_expert,
    local,
    model_classes,
    quiet,
    state_dict,
)
from moebench.libraries.transformers.parity import param_group
from moebench.parity.compare import EXACT, Tolerance
from moebench.parity.diagnosis import EXPERTS, OUTPUT

SAVE_STEPS = 2
"""Adam steps before the save: after two, exp_avg / exp_avg_sq differ from any single gradient's."""
CONTINUE_STEPS = 2
"""Steps after the load: the first uses the restored optimizer state, the second what it produced."""
ADAM_LR = 1e-2
ONE_PROCESS = "ep1"
"""The load layout without any distributed config: every rank loads the whole model (ep_size 1)."""
FRESH_INIT_RANGE = 0.0
"""initializer_range of the loading model's config: state transformers does not load is then zeros / ones."""
RESUME_OTHER_LAYOUT = Tolerance(
    rtol=1e-4, atol_fraction=1e-4,
    source="resume at another layout: 1e-4 relative, atol 1e-4 x largest |expected| (summation order through "
           "Adam; worst measured 3.1e-6 x largest |expected|)")
"""Another layout sums in another order, and Adam's 1/sqrt(v) amplifies that where a gradient is near zero (the
issue measured up to 4.7e-5 after two steps on DeepSpeed). Measured here, seeds 0-2 at W = 2 and 4: at most
3.1e-6 x the largest |expected| (a resumed loss at W = 4; parameters <= 1.1e-7 x), element-wise up to 8e-4
relative on near-zero elements, which the atol floor covers: ~30x margin, still 1000x below a 10 % error."""

RESUME_ROWS = (
    # (family, expert backend, SAVE layout, LOAD layout, distributed_checkpoint): a plain top-2 family under the
    # data-parallel all-to-all, loaded back there and under the all-reduce; a shared-expert family under the
    # TP-style all-to-all, loaded back there and as a whole model on every rank; the DCP (sharded) checkpoint
    # from the data-parallel layout into the TP-style one.
    ("mixtral", "grouped_mm", "all_to_all", "all_to_all", False),
    ("mixtral", "grouped_mm", "all_to_all", "all_reduce", False),
    ("qwen2_moe", "eager", "all_to_all+tp", "all_to_all+tp", False),
    ("qwen2_moe", "eager", "all_to_all+tp", ONE_PROCESS, False),
    ("mixtral", "grouped_mm", "all_to_all", "all_to_all+tp", True),
)
TRAINER_ROWS = (("mixtral", "grouped_mm", "all_to_all+tp"),)
"""(family, backend, layout) of the rows whose optimizer goes through the Trainer's checkpoint code, loaded at
the same layout: a TP-style layout, where the Trainer has no FSDP plugin and saves `optimizer.state_dict()` from
rank 0 alone (args.should_save) - every rank then loads rank 0's experts' Adam state (a finding on 5.23.0)."""
OPTIMIZER_PATHS = ("save_optimizer_distributed", "Trainer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeSettings(Settings):
    """A resume row's settings: its JSON fields, in this order (None values left out: a row loaded at its save
    layout, which is its ep_mode, has no load_ep_mode / load_ep_size)."""

    ep_size: int
    load_ep_mode: str | None = None
    """The layout the checkpoint is loaded into (an EP mode, or ONE_PROCESS); None: the save layout."""
    load_ep_size: int | None = None
    save_steps: int = SAVE_STEPS
    continue_steps: int = CONTINUE_STEPS
    load_optimizer_states: bool = True
    distributed_checkpoint: bool = False
    """save_pretrained(distributed_checkpoint=True): every rank writes its own shards through torch DCP."""
    optimizer_checkpoint: str = OPTIMIZER_PATHS[0]
    """Which code saves and loads the optimizer: one of OPTIMIZER_PATHS."""

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in super().fields().items() if v is not None}


def resume_rows(world_size: int) -> list[Row]:
    rows = []
    for model, backend, save, load, sharded in RESUME_ROWS:
        other = {} if load == save else {"load_ep_mode": load,
                                         "load_ep_size": 1 if load == ONE_PROCESS else world_size}
        settings = ResumeSettings(ep_size=world_size, distributed_checkpoint=sharded, **other)
        variant = "resume" + ("-dcp" if sharded else "") + ("" if load == save else f"-to-{load}")
        rows.append(Row(library="transformers", model=model, backend=backend, ep_mode=save, world_size=world_size,
                        kind=RESUME, features=("resume",), settings=settings, variant=variant))
    for model, backend, layout in TRAINER_ROWS:
        settings = ResumeSettings(ep_size=world_size, optimizer_checkpoint=OPTIMIZER_PATHS[1])
        rows.append(Row(library="transformers", model=model, backend=backend, ep_mode=layout, world_size=world_size,
                        kind=RESUME, features=("resume",), settings=settings, variant="resume-trainer"))
    return rows


def load_layout(row: Row) -> str:
    """The layout a resume row loads into."""
    return row.settings.load_ep_mode or row.ep_mode


QUIET_LOGGERS = ("torch.distributed.tensor._redistribute", "torch.distributed.device_mesh")
"""DTensor's "sequential all_gather operations" notes (gathering the FSDP x EP experts) and DeviceMesh's "pickling
... before the PGs were created" (torch.load of the Trainer's optimizer file): every rank's, on stderr."""


@contextlib.contextmanager
def _quiet_dtensor():
    """QUIET_LOGGERS stay off the console for the row."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _layout_model(model_cls, config, row: Row, layout: str, source, state_dict=None):
    """from_pretrained(source) in `layout` (ep1: no distributed config)."""
    kwargs: dict[str, Any] = dict(config=config, experts_implementation=row.backend)
    if state_dict is not None:
        kwargs["state_dict"] = state_dict
    if layout != ONE_PROCESS:
        kwargs["distributed_config"] = distributed_config(dataclasses.replace(row, ep_mode=layout))
    model = model_cls.from_pretrained(source, **kwargs)
    model.train()
    return model


def _steps(block, opt, row: Row, layout: str, seed: int, steps: range, rank: int, world: int) -> list[float]:
    """Adam steps on the block in `layout`; the global loss of each (the mean over every token of the batch)."""
    import torch.distributed as dist

    shared = layout == ONE_PROCESS or shares_batch(dataclasses.replace(row, ep_mode=layout))
    rows = slice(None) if shared else slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
    losses = []
    for step in steps:
        x_all, t_all = batch(seed, step, world)
        y = block(x_all[rows])
        loss = (y * t_all[rows]).sum() / t_all[rows][..., 0].numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if not shared:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    return losses


def _snapshot(block, opt) -> dict[str, dict[str, Any]]:
    """name -> {quantity: whole tensor} of the block's parameters and their Adam state (a collective)."""
    import torch

    from moebench.parity import restore

    out: dict[str, dict[str, Any]] = {}
    for name, p in block.named_parameters():
        state = opt.state.get(p, {})
        out[name] = {restore.WEIGHTS: full(p.detach()).clone()}
        for q in (restore.EXP_AVG, restore.EXP_AVG_SQ):
            out[name][q] = full(state[q]).clone() if q in state else torch.zeros(p.shape)
        out[name][restore.STEP] = torch.as_tensor(full(state["step"]) if "step" in state else 0.0).clone()
    return out


def _local_state(block, opt) -> dict[str, dict[str, Any]]:
    """name -> {quantity: what THIS rank holds}: its experts' rows, dense parameters whole (a collective)."""
    import torch

    from moebench.parity import restore

    out: dict[str, dict[str, Any]] = {}
    for name, p in block.named_parameters():
        state = opt.state.get(p, {}) if opt is not None else {}
        view = local if is_expert(name) else full
        out[name] = {restore.WEIGHTS: view(p.detach()).clone(), "offset": expert_offset(p)}
        for q in (restore.EXP_AVG, restore.EXP_AVG_SQ):
            out[name][q] = view(state[q]).clone() if q in state else torch.zeros(view(p.detach()).shape)
        out[name][restore.STEP] = torch.as_tensor(full(state["step"]) if "step" in state else 0.0).clone()
    return out


def _findings(got: dict, fresh: dict, want: dict, rank: int) -> list:
    """(comparison name, Finding) for every expert slot and dense parameter, every quantity."""
    from moebench.parity import restore

    dense = [n for n in want if not is_expert(n)]
    out = []
    for name, held in got.items():
        for q in (restore.WEIGHTS, restore.EXP_AVG, restore.EXP_AVG_SQ, restore.STEP):
            if q == restore.STEP or not is_expert(name):
                slot = restore.Slot(rank=rank, local=None, unit=name)
                candidates = {n: want[n][q] for n in dense} if q != restore.STEP else {name: want[name][q]}
                out.append((f"restored {name} {q}", restore.identify(slot, q, held[q], candidates, fresh[name][q])))
                continue
            candidates = dict(enumerate(want[name][q]))
            for j in range(held[q].shape[0]):
                e = held["offset"] + j
                slot = restore.Slot(rank=rank, local=j, unit=e)
                out.append((f"restored {name}[expert {e}] {q}",
                            restore.identify(slot, q, held[q][j], candidates, fresh[name][q][j])))
    return out


def _trainer_stand_in(folder, opt):
    """What Trainer._save_optimizer_and_scheduler / _load_optimizer_and_scheduler read of the Trainer: its
    arguments, optimizer and scheduler, and that neither DeepSpeed nor an FSDP plugin is on."""
    import types

    import torch
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(folder), report_to=[], use_cpu=True)
    return types.SimpleNamespace(args=args, optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 1.0), is_deepspeed_enabled=False, is_fsdp_enabled=False, is_fsdp_xla_v1_enabled=False)


def _save_optimizer(model, opt, folder, how: str) -> None:
    import torch.distributed as dist
    from transformers.distributed import save_optimizer_distributed

    if how == OPTIMIZER_PATHS[0]:
        save_optimizer_distributed(model, opt, str(folder))
        return
    from transformers import Trainer

    folder.mkdir(exist_ok=True)
    Trainer._save_optimizer_and_scheduler(_trainer_stand_in(folder, opt), str(folder))
    dist.barrier()  # the Trainer writes on rank 0 alone; the others read it when they resume


def _load_optimizer(model, opt, folder, how: str) -> None:
    from transformers.distributed import load_optimizer_distributed

    if how == OPTIMIZER_PATHS[0]:
        load_optimizer_distributed(model, opt, str(folder))
        return
    from transformers import Trainer

    Trainer._load_optimizer_and_scheduler(_trainer_stand_in(folder, opt), str(folder))


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, with transformers' progress bars, info logs and warnings off the console."""
    with quiet():
        return _run(ctx, row, opts)


def _run(ctx, row: Row, opts) -> list:
    """Every rank: train, save, continue (uninterrupted) | load at the row's load layout, identify, continue."""
    import torch

    from moebench.libraries.resume import restore_comparisons, shared_dir
    from moebench.parity.compare import compare

    r, w, seed = ctx.rank, ctx.world_size, opts.seed
    layout = load_layout(row)
    tol = EXACT if layout == row.ep_mode else RESUME_OTHER_LAYOUT
    config_cls, model_cls, kwargs = model_classes(row.model)
    config = config_cls(**kwargs)
    save_steps, later = range(SAVE_STEPS), range(SAVE_STEPS, SAVE_STEPS + CONTINUE_STEPS)
    out: list = []
    with _quiet_dtensor(), shared_dir("hf-resume") as folder:
        model = _layout_model(model_cls, config, row, row.ep_mode, None, state_dict(model_cls, config, seed))
        block = model.get_submodule(BLOCK)
        opt = torch.optim.Adam(block.parameters(), lr=ADAM_LR)
        _steps(block, opt, row, row.ep_mode, seed, save_steps, r, w)
        model.save_pretrained(folder / "model", distributed_checkpoint=row.settings.distributed_checkpoint)
        how = row.settings.optimizer_checkpoint
        _save_optimizer(model, opt, folder / "optimizer", how)
        want = _snapshot(block, opt)
        ref_losses = _steps(block, opt, row, row.ep_mode, seed, later, r, w)
        ref_final = {name: full(p.detach()).clone() for name, p in block.named_parameters()}
        del model, block, opt

        fresh_config = config_cls(**kwargs, initializer_range=FRESH_INIT_RANGE)
        fresh = _layout_model(model_cls, fresh_config, row, layout, None, state_dict={})
        fresh_state = _local_state(fresh.get_submodule(BLOCK), None)
        del fresh
        loaded = _layout_model(model_cls, fresh_config, row, layout, str(folder / "model"))
        block = loaded.get_submodule(BLOCK)
        opt = torch.optim.Adam(block.parameters(), lr=ADAM_LR)
        _load_optimizer(loaded, opt, folder / "optimizer", how)
        out += restore_comparisons(_findings(_local_state(block, opt), fresh_state, want, r), r)
        losses = _steps(block, opt, row, layout, seed, later, r, w)
    for step, got, expected in zip(later, losses, ref_losses):
        out.append(compare(f"loss at step {step + 1} (resumed vs uninterrupted)", torch.tensor(got),
                           torch.tensor(expected), tol, rank=r, group=OUTPUT))
    for name, p in block.named_parameters():
        label = f"after {CONTINUE_STEPS} resumed Adam steps"
        if is_expert(name):
            held, offset = local(p.detach()), expert_offset(p)
            for j in range(held.shape[0]):
                out.append(compare(f"{name}[expert {offset + j}] {label}", held[j], ref_final[name][offset + j],
                                   tol, rank=r, group=EXPERTS))
        else:
            out.append(compare(f"{name} {label}", full(p.detach()), ref_final[name], tol, rank=r,
                               group=param_group(name)))
    return out
