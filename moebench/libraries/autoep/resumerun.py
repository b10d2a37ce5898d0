"""An AutoEP resume row on every rank (the rows and their settings: resume.py): engine A trains, saves through
DeepSpeed's own `save_checkpoint` (and `ds_to_universal`), continues; engine B is built fresh from another seed in the
load layout and `load_checkpoint`s; every slot is matched, B continues against A, A against one process. Each phase
opens with an assertion every rank makes alike, whose diagnosis names the row by its first failing phase."""

from __future__ import annotations

from typing import Any

import torch

from moebench.libraries.autoep import resumemath as rx
from moebench.libraries.autoep.resume import (
    CHECKPOINT_REFUSED,
    FRESH_SEED_OFFSET,
    GROUPS,
    ONE_PROCESS,
    ONE_PROCESS_DIFFERS,
    RESUME_DIVERGES,
    RESUME_OTHER_LAYOUT,
    ROUTING_BIAS_DROPPED,
    ROUTING_STATE_DIVERGED,
    ResumeSettings,
    first_line,
    unit_label,
)
from moebench.libraries.spec import Row
from moebench.parity.compare import EXACT, Comparison, assertion, compare
from moebench.parity.diagnose import FIRST_DIVERGENCE
from moebench.parity.diagnosis import EXPERTS, OUTPUT, REPLICATED, ROUTER, VACUOUS_ROW, make
from moebench.parity.registry import Refused


def run(ctx, row: Row, opts) -> list[Comparison]:
    """Runs on every rank: the row's save -> load -> continue, compared (the module's docstring)."""
    from moebench.libraries.autoep.run import quiet_transformers, registry_shim
    from moebench.libraries.resume import shared_dir
    from moebench.parity.checks_deepspeed import group_timeout_s, new_groups_time_out_after
    from moebench.parity.checks_engine import quiet_deepspeed
    from moebench.variants.deepspeed.comm import deepspeed_comm

    with new_groups_time_out_after(group_timeout_s(opts.timeout_s)), \
            deepspeed_comm(ctx, compiled_ops=False, timeout_s=opts.timeout_s), quiet_deepspeed(), \
            quiet_transformers(), registry_shim(row.settings), shared_dir("autoep-resume") as folder:
        out = Resume(ctx, row.settings, opts.seed, str(folder)).run()
    for c in out:
        c.rank = ctx.rank
    return out


def _head(name: str, passed: bool, diagnosis: dict | None, group: str = REPLICATED) -> Comparison:
    """A phase's opening assertion, made alike on every rank; failed, it carries the phase's named diagnosis."""
    head = assertion(name, passed, group=group, note="" if passed else f"{diagnosis['name']}: {diagnosis['sentence']}")
    head.diagnosis = None if passed else diagnosis
    return head


def _first(name: str, sentence: str, **details) -> dict:
    return make(name, sentence, **{FIRST_DIVERGENCE: True, **details})


def _gather(obj) -> list:
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _agree(error: str | None) -> str | None:
    """The first rank's error, on every rank (all ranks refuse together or none does)."""
    return next((e for e in _gather(error) if e), None)


def _merged(units: dict) -> dict:
    """Every rank's units merged (an expert's replicas hold the same state in a correct run)."""
    merged: dict = {}
    for part in _gather(units):
        for unit, state in part.items():
            merged.setdefault(unit, state)
    return merged


class Resume:
    """One row on one rank: the phases in order, each appending its comparisons to `out`."""

    def __init__(self, ctx, s: ResumeSettings, seed: int, folder: str) -> None:
        self.ctx, self.s, self.seed, self.folder = ctx, s, seed, folder
        self.r, self.w = ctx.rank, ctx.world_size
        self.same_layout = (s.load_ep_size, s.load_zero_stage, s.load_ep_mode) == (s.autoep_size, s.zero_stage, "")
        self.tol = EXACT if self.same_layout else RESUME_OTHER_LAYOUT
        self.out: list[Comparison] = []
        self.restored = False

    # ---- the uninterrupted run A
    def run(self) -> list[Comparison]:
        from moebench.libraries.autoep import rowmath as rm

        s, k, m = self.s, self.s.save_steps, self.s.continue_steps
        ref = self._reference(k + m)
        model = rm.build(s.family, 2, self.seed)
        ids = {id(p): n for n, p in model.named_parameters()}
        _, model_bias = rx.routing_bias(model)
        a = self._initialize_a(model)
        self._kept_bias(a, model_bias)
        a_losses, biases = [], []
        for step in range(k):
            a_losses += rx.train(a, self.seed, range(step, step + 1), self.r)
            biases.append(rx.routing_bias(a.module)[1])
        self._agreement(biases)
        want = _merged(rx.unit_state(a, s.zero_stage))
        self._distinct(want)
        saved_bias = _gather(biases[-1])
        a.save_checkpoint(self.folder, tag=rx.TAG)
        converted = self._convert() if s.universal else None
        a_first = self._forward_loss(a, k)
        a_after = []
        for step in range(k, k + m):
            a_losses += rx.train(a, self.seed, range(step, step + 1), self.r)
            a_after.append((self._mean(a_losses[-1]), self._units(a), rx.routing_bias(a.module)[1]))
        one = self._one_process(a, ids, a_losses, ref)
        if hasattr(a, "destroy"):
            a.destroy()
        del a
        rx.forget_expert_groups()
        if converted:
            self._refused(f"DeepSpeed's ds_to_universal refused its own checkpoint: {first_line(converted)}")
        else:
            self._resumed(want, saved_bias, a_first, a_after)
        self.out += one
        return self.out

    def _initialize_a(self, model):
        """deepspeed.initialize at the save layout; a release without AutoEP's ZeRO 3 skips the row with its
        message (AutoEP's ZeRO 3 came with deepspeedai/DeepSpeed#8060)."""
        from moebench.parity.registry import SkipCheck

        try:
            return rx.initialize(model, rx.resume_config(self.s.zero_stage, self.s.autoep_size, self.w))
        except AssertionError as exc:
            if self.s.zero_stage == 3 and "Stage 3" in str(exc):
                raise SkipCheck(f"this DeepSpeed's AutoEP has no ZeRO 3: deepspeed.initialize raises "
                                f"AssertionError: {first_line(str(exc))} (it came with deepspeedai/DeepSpeed#8060)"
                                ) from None
            raise

    def _convert(self) -> str | None:
        """DeepSpeed's converter on rank 0: None, or its error (every rank agrees on it)."""
        error = None
        if self.r == 0:
            try:
                rx.convert_universal(self.folder)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the converter's refusal is the finding
                error = f"{type(exc).__name__}: {exc}"
        return _agree(error)

    def _refused(self, sentence: str) -> None:
        """DeepSpeed refused what the row asked. Where DeepSpeed supports it (a load at the layout it saved, or its
        universal checkpoint, its documented way to another layout) that is a failure, CHECKPOINT_REFUSED; elsewhere
        (a regular load at another layout, AutoEP switched off) a documented limitation: the verdict "refused"."""
        if not (self.same_layout or self.s.universal):
            raise Refused(sentence)
        self.out.append(_head("DeepSpeed loads its own checkpoint", False, _first(CHECKPOINT_REFUSED, sentence,
                                                                                   where="load")))

    def _reference(self, steps: int) -> dict:
        """The one-process run, on rank 0 alone, sent to every rank as it is (pickled: bit for bit)."""
        import torch.distributed as dist

        from moebench.libraries.autoep import rowmath as rm

        box = [rx.reference_run(rm.build(self.s.family, 2, self.seed), self.seed, self.w, steps)
               if self.r == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _mean(self, loss: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = loss.detach().double().clone()
        dist.all_reduce(total)
        return total / self.w

    def _forward_loss(self, engine, step: int) -> torch.Tensor:
        with torch.no_grad():
            return self._mean(rx.loss_of(engine, rx.batch(self.seed, step, 0, self.r)))

    def _units(self, engine, stage: int | None = None) -> dict:
        """The engine's module weights and AdamW step by unit (every rank's, where the layouts differ)."""
        own = {u: (q[rx.WEIGHTS], q[rx.STEP]) for u, q in
               rx.unit_state(engine, self.s.zero_stage if stage is None else stage, (rx.STEP,)).items()}
        return own if self.same_layout else _merged(own)

    # ---- premises and routing state
    def _kept_bias(self, engine, model_bias) -> None:
        """AutoEP keeps the model's routing bias (its value) where the model has one."""
        if model_bias is None:
            return
        name, kept = rx.routing_bias(engine.module)
        ok = kept is not None and bool(torch.equal(kept, model_bias))
        what = "holds no routing bias" if kept is None else f"holds {name} with another value"
        self.out.append(_head(f"AutoEP keeps the model's routing bias ({rx.BIAS})", ok, None if ok else _first(
            ROUTING_BIAS_DROPPED, f"after deepspeed.initialize AutoEP's layer {what}: the model's {rx.BIAS} (a "
            "buffer of its router) was not carried over, so AutoEP routes without it (deepspeedai/DeepSpeed#8369)",
            where="conversion"), group=ROUTER))

    def _agreement(self, biases: list) -> None:
        """Before the save, at every step, every rank holds the same routing bias."""
        if biases[0] is None:
            return
        for step, bias in enumerate(biases):
            everyone = _gather(bias)
            apart = [q for q, b in enumerate(everyone) if not torch.equal(b, everyone[0])]
            if apart:
                worst = max(float((everyone[q] - everyone[0]).abs().max()) for q in apart)
                self.out.append(_head(f"the ranks agree on the routing bias at step {step + 1}", False, _first(
                    ROUTING_STATE_DIVERGED, f"at step {step + 1}, before any save, rank(s) {apart} hold another "
                    f"{rx.BIAS} than rank 0 (max |diff| {worst:.3g}): DeepSpeed saves the non-expert state of "
                    "data-parallel rank 0 alone, so a resumed run gives every rank rank 0's", ranks=apart,
                    step=step + 1), group=ROUTER))
                return
        self.out.append(_head(f"the ranks agree on the routing bias at steps 1-{len(biases)}", True, None,
                              group=ROUTER))

    def _distinct(self, want: dict) -> None:
        """Every global expert's saved state differs from every other's (else a permutation could not show)."""
        experts = sorted(u for u in want if isinstance(u, int))
        alike = [(a, b) for i, a in enumerate(experts) for b in experts[i + 1:]
                 if any(torch.equal(want[a][q], want[b][q]) for q in want[a] if q != rx.STEP)]
        self.out.append(_head(f"every expert's saved state is its own ({len(experts)} experts)", not alike, _first(
            VACUOUS_ROW, f"experts {alike[0]} hold equal state at the save: a load that swaps them could not show",
            where="premise") if alike else None, group=EXPERTS))

    # ---- the resumed run B
    def _resumed(self, want: dict, saved_bias: list, a_first: torch.Tensor, a_after: list) -> None:
        from moebench.libraries.autoep import rowmath as rm
        from moebench.libraries.resume import restore_comparisons
        from moebench.parity import restore

        s = self.s
        b = self._fresh(s.load_zero_stage, s.load_ep_size, autoep=not s.load_ep_mode)
        fresh = rx.unit_state(b, s.load_zero_stage)
        bias_name, fresh_bias = rx.routing_bias(b.module)
        error = self._load(b)
        if error:
            self._refused(self._refusal(error))
            return
        got, slots = rx.unit_state(b, s.load_zero_stage), rx.slots(b)
        findings, foreign = [], sorted(str(u) for u in got if u not in want)
        for unit in sorted(got, key=lambda u: (isinstance(u, str), u)):
            if unit not in want:
                continue
            slot = restore.Slot(rank=self.r, local=slots.get(unit) if isinstance(unit, int) else None, unit=unit)
            where = slot.where() + (f" (expert {unit})" if slot.local is not None else "")
            for q in [q for q in restore.QUANTITIES if q in got[unit] and q in want[unit]]:
                candidates = {u: st[q] for u, st in want.items() if q in st}
                findings.append((f"after the load: {where} {q}",
                                 restore.identify(slot, q, got[unit][q], candidates, fresh[unit][q])))
        _, bias = rx.routing_bias(b.module)
        if saved_bias[self.r] is not None and bias is not None:
            label = rm.label(bias_name)
            candidates = {label: saved_bias[self.r], **{f"rank {q}'s {label}": t for q, t in enumerate(saved_bias)
                                                         if q != self.r and not torch.equal(t, saved_bias[self.r])}}
            slot = restore.Slot(rank=self.r, local=None, unit=label)
            findings.append((f"after the load: rank {self.r}, routing bias {label}",
                             restore.identify(slot, restore.WEIGHTS, bias, candidates, fresh_bias)))
        restored = restore_comparisons(findings, self.r)
        self.restored = restored[0].passed
        self.out += restored
        if foreign:
            self.out.append(assertion("every loaded unit is one of the saved model's", False, group=REPLICATED,
                                      note=f"not in the saved model: {', '.join(foreign[:6])}"))
        self._continued(b, a_first, a_after)

    def _fresh(self, stage: int, ep: int, *, autoep: bool = True):
        from moebench.libraries.autoep import rowmath as rm

        config = rx.resume_config(stage, ep, self.w, universal=self.s.universal, expert_parallel=autoep)
        return rx.initialize(rm.build(self.s.family, 2, self.seed + FRESH_SEED_OFFSET), config)

    def _load(self, engine) -> str | None:
        """load_checkpoint on every rank: None, or the first rank's refusal (every rank agrees on it)."""
        try:
            rx.load(engine, self.folder, self.s.universal)
            error = None
        except Exception as exc:  # noqa: BLE001 - a refusal is the row's verdict
            error = f"{type(exc).__name__}: {exc}"
        return _agree(error)

    def _refusal(self, error: str) -> str:
        """DeepSpeed's first line; for a load in another layout, whether the same checkpoint loads at its save
        layout (a fresh engine there: the control), i.e. whether the layout change is the cause."""
        s = self.s
        first = f"DeepSpeed refused the load: {first_line(error)}"
        if self.same_layout:
            return first
        rx.forget_expert_groups()
        control = self._load(self._fresh(s.zero_stage, s.autoep_size))
        to = "AutoEP off" if s.load_ep_mode else f"autoep_size {s.load_ep_size}"
        if control:
            return f"{first} (refused at its save layout too: {first_line(control)}; not about the layout)"
        return f"{first} (saved at autoep_size {s.autoep_size}, loaded with {to}; it loads at its save layout)"

    def _continued(self, b, a_first: torch.Tensor, a_after: list) -> None:
        """The first resumed loss, then each continued step's AdamW step count, loss, weights and routing bias,
        against A."""
        s, k = self.s, self.s.save_steps
        shared = rx.shared_step_tensors(b)
        comps = [assertion("after the load, every parameter group's AdamW step is a tensor of its own", not shared,
                           group=REPLICATED, note="" if not shared else
                           f"{shared} optimizer state entries share one step tensor with another: torch's AdamW "
                           "increments it in place once per entry, so every entry after the first steps ahead"),
                 compare("first resumed loss (forward only)", self._forward_loss(b, k), a_first, self.tol,
                         world_size=self.w, group=OUTPUT)]
        for i, (loss, units, bias) in enumerate(a_after):
            try:
                got = self._mean(rx.train(b, self.seed, range(k + i, k + i + 1), self.r)[0])
            except Exception as exc:  # noqa: BLE001 - a resumed run that cannot train is the row's finding
                comps.append(assertion(f"continued step {i + 1}: trains", False, group=REPLICATED,
                                       note=f"raised {type(exc).__name__}: {first_line(str(exc))}"))
                break
            comps.append(compare(f"continued step {i + 1}: loss", got, loss, self.tol, world_size=self.w,
                                 group=OUTPUT))
            if not self.restored:  # a wrong restore's consequences: the losses show them; every unit would too
                continue
            mine = self._units(b, s.load_zero_stage)
            for unit, (_, step) in mine.items():
                if unit in units:
                    comps.append(compare(f"continued step {i + 1}: AdamW step of {unit_label(unit)}", step,
                                         units[unit][1], EXACT, world_size=self.w, group=REPLICATED))
            for unit, (t, _) in mine.items():
                if unit in units:
                    comps.append(compare(f"continued step {i + 1}: {unit_label(unit)}", t, units[unit][0], self.tol,
                                         world_size=self.w, group=EXPERTS if isinstance(unit, int) else REPLICATED))
            b_bias = rx.routing_bias(b.module)[1]
            if bias is not None and b_bias is not None:
                comps.append(compare(f"continued step {i + 1}: routing bias", b_bias, bias, EXACT,
                                     world_size=self.w, group=ROUTER))
        lead = ("every restored slot matched the save, yet the resumed run does not continue as the one that never "
                "stopped" if self.restored else "the resumed run does not continue as the one that never stopped "
                "(the restore finding above)")
        self._phase("the continued run equals the uninterrupted run", comps, RESUME_DIVERGES,
                    lead.replace("{", "{{").replace("}", "}}") + ": {what}: {how}")

    def _phase(self, name: str, comps: list[Comparison], diagnosis: str, template: str) -> None:
        """`comps` opened by an assertion every rank makes alike: failed when any rank's comparison failed, named by
        the earliest failure over the ranks."""
        mine = next(((i, c.name, c.note or f"max |diff| {c.max_abs_diff:.3g}") for i, c in enumerate(comps)
                     if c.asserted and not c.passed), None)
        failures = [(f, q) for q, f in enumerate(_gather(mine)) if f is not None]
        if not failures:
            self.out += [_head(name, True, None), *comps]
            return
        (_, what, how), rank = min(failures)
        sentence = template.format(what=f"rank {rank}, {what}", how=how)
        self.out += [_head(name, False, _first(diagnosis, sentence, where=what, rank=rank)), *comps]

    # ---- A against one process
    def _one_process(self, a, ids: dict, a_losses: list, ref: dict) -> list[Comparison]:
        """A's loss at every step and every parameter after the last, against the one-process run (ONE_PROCESS).
        Kept aside, appended after the resume phases: the resume verdict is about the checkpoint."""
        from moebench.libraries.autoep import rowmath as rm
        from moebench.libraries.autoep.run import by_unit, units_of

        comps = [compare(f"uninterrupted vs one process, step {i + 1}: loss", self._mean(loss), ref["losses"][i],
                         ONE_PROCESS, world_size=self.w, group=OUTPUT) for i, loss in enumerate(a_losses)]
        held = rm.experts_held(a.module.get_submodule(rm.MLP[:-1]))
        units = units_of(a, ids, held)
        weights = rx.param_state(a, self.s.zero_stage, ())  # ZeRO 3: gathered
        mine = by_unit({n: q[rx.WEIGHTS].double() for n, q in weights.items()}, units, held)
        expected = rm.reference_units(ref["params"][-1])
        last = len(a_losses)
        comps += [compare(f"uninterrupted vs one process, step {last}: {rm.label(u)}", t, expected[u], ONE_PROCESS,
                          world_size=self.w, group=GROUPS[rm.group_of(u)]) for u, t in mine.items()]
        unknown = sorted(n for n, u in units.items() if u == "")
        if unknown:
            comps.append(assertion("every AutoEP parameter is one of the model's", False, group=REPLICATED,
                                   note=f"unknown: {', '.join(unknown)}"))
        bias = rx.routing_bias(a.module)[1]
        if ref["bias"][-1] is not None and bias is not None:
            comps.append(compare(f"uninterrupted vs one process, step {last}: routing bias", bias, ref["bias"][-1],
                                 EXACT, world_size=self.w, group=ROUTER))
        saved, self.out = self.out, []
        self._phase("the uninterrupted run equals one process", comps, ONE_PROCESS_DIFFERS,
                    "the run that never stopped already differs from the same model on one process: {what}: {how}")
        one, self.out = self.out, saved
        return one
