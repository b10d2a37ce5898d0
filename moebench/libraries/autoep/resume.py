"""AutoEP resume rows (`verify-parity --library autoep --resume`): save -> load -> continue through DeepSpeed's own
checkpointing, as its users call it, must equal the run that never stopped. The rows and their settings here; a row
on every rank in resumerun.py; what it does with DeepSpeed in resumemath.py.

Every row, on every rank (gloo, CPU; AdamW as torch's own optimizer through the config's `torch_adam`, no JIT op):
1. engine A (the row's family from its tiny config, seed s, the save layout) trains SAVE_STEPS AdamW steps; at each
   the ranks must agree on the routing bias (DeepSeek-V3's `e_score_correction_bias`, a buffer); then
   `engine.save_checkpoint(dir, tag)` into a rank-shared folder under moebench's temporary root (removed after any
   outcome), for universal rows DeepSpeed's converter (`ds_to_universal`) on rank 0, and A trains CONTINUE_STEPS
   more: the uninterrupted run;
2. the ranks forget DeepSpeed's expert groups (a resumed job's fresh processes have none: resumemath), and engine B
   is built FRESH from another seed in the load layout and `load_checkpoint`s (universal rows: with
   `checkpoint.load_universal`);
3. right after the load every expert slot of every rank (by the GLOBAL expert AutoEP's placement puts there) and
   every other parameter is matched against every global expert's state at the save: module weights, fp32 master
   (ZeRO 1-3), AdamW's exp_avg, exp_avg_sq and step, and the routing bias on every rank (parity/restore.py,
   libraries/resume.restore_comparisons): a wrong slot is named with what it holds;
4. the first resumed loss, then the loss, every parameter and the routing bias after each continued step, against
   A: bit for bit where the layout is unchanged, within RESUME_OTHER_LAYOUT where it is not;
5. A against the same model on one process (torch AdamW on every rank's slice) within ONE_PROCESS.
Each phase opens with an assertion every rank makes alike, whose diagnosis names the row by its first failing phase
(the later ones are its consequences). A load DeepSpeed refuses is the verdict "refused" with its first line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moebench.libraries.autoep import compat
from moebench.libraries.autoep.rows import NAME, ep_sizes
from moebench.libraries.spec import RESUME, Row, Settings
from moebench.parity.compare import Tolerance
from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER

SAVE_STEPS = 2
"""AdamW steps before the save: two, so the step count and both moments are past their first value."""
CONTINUE_STEPS = 2
"""Steps after the load: the first shows wrong optimizer state, the second its compounding."""
FRESH_SEED_OFFSET = 7_919
"""The fresh model's seed is the row's + this: every weight (and the routing bias) differs, so a slot never
restored shows as the fresh model's."""
ONE_PROCESS = Tolerance(rtol=1e-5, atol_abs=1e-4,
                        source="EP vs one process under AdamW: float32 summation order, which AdamW turns into up "
                               "to lr where a gradient is ~0 (DeepSpeed's resume rows' ONE_PROCESS)")
"""The uninterrupted run against one process: the reductions sum in another order (and AutoEP's grouped experts
compute in another order than the Hugging Face experts), which AdamW amplifies on elements whose gradient is near
zero; the same bound as DeepSpeed's own resume rows (libraries/deepspeed/resume.ONE_PROCESS). Not the resume
verdict's edge: that is the exact comparison with the uninterrupted run in the same layout."""
RESUME_OTHER_LAYOUT = ONE_PROCESS
"""A load at another autoep_size continues in another layout, whose reductions sum in another order."""
ROUTING_BIAS_DROPPED = "routing-bias-dropped"
"""AutoEP's layer does not hold the model's routing bias (its value) after deepspeed.initialize."""
ROUTING_STATE_DIVERGED = "routing-state-diverged"
"""The ranks hold different routing biases before the save: the checkpoint keeps data-parallel rank 0's."""
RESUME_DIVERGES = "resume-diverges"
"""Every restored slot matches the save, yet the continued run differs from the one that never stopped."""
CHECKPOINT_REFUSED = "checkpoint-refused"
"""DeepSpeed refuses a checkpoint it wrote where it supports the load (the same layout; its universal checkpoint)."""
ONE_PROCESS_DIFFERS = "one-process-differs"
"""The uninterrupted run itself differs from the same model on one process (no resume needed to show it)."""
NOTE = "DeepSpeed's expert groups forgotten before the load, as in a resumed job's fresh processes"
"""Said under every resume row: the one thing the row does to DeepSpeed's state that a user's job does not."""
OFF = 0
"""`load_ep` of a row that loads with AutoEP off (the model's own experts, every rank all of them)."""
AUTOEP_OFF = "autoep-off"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeSettings(Settings):
    """An AutoEP resume row's settings; its JSON fields (load_* only where the load's layout differs)."""

    family: str
    zero_stage: int
    autoep_size: int
    load_zero_stage: int
    load_ep_size: int
    """autoep_size at the load (1 with AutoEP off: every rank holds every expert)."""
    load_ep_mode: str = ""
    """"autoep-off": loaded with expert_parallel disabled (the model's own experts); "": AutoEP at the load too."""
    universal: bool = False
    """Convert with ds_to_universal, load with checkpoint.load_universal."""
    save_steps: int = SAVE_STEPS
    continue_steps: int = CONTINUE_STEPS
    optimizer: str = "AdamW (torch_adam)"
    transformers: str = ""
    transformers_shim: str = ""

    def fields(self) -> dict[str, Any]:
        same = {"load_ep_size": self.autoep_size, "load_zero_stage": self.zero_stage, "load_ep_mode": ""}
        return {k: v for k, v in super().fields().items() if k not in same or v != same[k]}


# ------------------------------------------------------------------ the rows


def _row(world: int, tf: str | None, family: str, stage: int, ep: int, *, load_ep: int | None = None,
         load_stage: int | None = None, universal: bool = False) -> Row:
    load_ep = ep if load_ep is None else load_ep
    load_stage = stage if load_stage is None else load_stage
    s = ResumeSettings(family=family, zero_stage=stage, autoep_size=ep, load_zero_stage=load_stage,
                       load_ep_size=max(load_ep, 1), load_ep_mode=AUTOEP_OFF if load_ep == OFF else "",
                       universal=universal, transformers=tf or "?",
                       transformers_shim=compat.shim_line(tf) if compat.needs_shim(tf) else "")
    to_ep = "" if load_ep == ep else f"to{load_ep if load_ep != OFF else '-'}"
    return Row(library=NAME, model=family, backend=f"zero{stage}" + (f"to{load_stage}" if load_stage != stage else ""),
               ep_mode=f"ep={ep}{to_ep}", world_size=world, kind=RESUME, settings=s,
               features=("resume", *(["universal"] if universal else [])),
               variant="resume+universal" if universal else "resume", note=NOTE)


def resume_rows(world: int, tf: str | None) -> list[Row]:
    """The resume matrix at `world`: the same layout at every ZeRO stage, the routing bias (DeepSeek-V3), a changed
    autoep_size through the universal checkpoint (DeepSpeed's documented way) and through a regular load (which
    its docs say needs the same autoep_size), and AutoEP switched off at the load. At W = 4 (ep 4 and 2) the
    regular and universal ZeRO 2 loads to ep 1 are left out (ZeRO 1 shows both; W = 2 runs them), which keeps the
    rows within the issue's 60 s there (docs/libraries/autoep.md times them)."""
    if world < 2:
        return []
    ep = world
    small = min(ep_sizes(world))  # 2: at W = 4 the experts' ZeRO partition spans 2 ranks
    rows = [_row(world, tf, "mixtral", s, ep) for s in (0, 1, 2, 3)]
    if small < ep:
        rows += [_row(world, tf, "mixtral", s, small) for s in (1, 3)]
    rows.append(_row(world, tf, "deepseek_v3", 1, ep))
    rows += [_row(world, tf, "mixtral", s, ep, load_ep=1) for s in ((0, 1, 2) if world == 2 else (0, 1))]
    rows.append(_row(world, tf, "mixtral", 3, ep, load_ep=small if small < ep else 1))
    rows.append(_row(world, tf, "mixtral", 1, ep, load_ep=OFF))
    rows.append(_row(world, tf, "mixtral", 1, ep, universal=True))
    rows += [_row(world, tf, "mixtral", s, ep, load_ep=1, universal=True) for s in ((1, 2) if world == 2 else (1,))]
    if small < ep:
        rows += [_row(world, tf, "mixtral", 1, ep, load_ep=small, universal=True),
                 _row(world, tf, "mixtral", 2, small, load_ep=ep, universal=True)]
    rows.append(_row(world, tf, "mixtral", 3, ep, load_ep=small if small < ep else 1, universal=True))
    rows.append(_row(world, tf, "deepseek_v3", 1, ep, universal=True))
    return rows


def first_line(message: str) -> str:
    """The message's first line (with the next when it ends in ":", as torch's "Error(s) in loading state_dict
    for X:" does before the keys), one line of at most 300 characters."""
    lines = [" ".join(ln.split()) for ln in message.splitlines() if ln.strip()] or [message.strip()]
    first = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return first[:300]


GROUPS = {"experts": EXPERTS, "router": ROUTER, "dense": REPLICATED}
"""A rowmath group's diagnosis group."""


def unit_label(unit) -> str:
    """A unit as comparisons name it: "global expert 5", or the parameter's name without the layer's prefix."""
    from moebench.libraries.autoep import rowmath as rm

    return f"global expert {unit}" if isinstance(unit, int) else rm.label(unit)
