"""A float32 Megatron row, on every rank: megatron-core's MoE layer through its DDP, finalize_model_grads and optimizer
(step.py) for STEPS Adam steps with clipping, against the same mathematics on one process (reference.py).

Per step, in this order (the first failure headlines the row's diagnosis): the output of this rank's tokens, the
loss, every gradient after finalize_model_grads (the router's, every expert's by its GLOBAL index and ETP slice, the
shared expert's), the gradient norm Megatron's optimizer clips by, the input gradient, the expert bias after its
update, then every parameter after optimizer.step() by global unit. Distributed-optimizer rows leave each gradient
reduce-scattered (a rank holds only its shard of the buffer): their gradients are not compared, their norm and
parameters are.

A failure is matched against what known-wrong mechanisms would give (`alternatives`), computed from the reference:
expert gradients x ep_size (`expert-grad-scale`), each expert-DP replica's own share (`expert-dp-unreduced`), the aux
and z losses' share x 1/TP (`aux-loss-scale`), and norms without the experts (`clip-norm-without-group`), without
the experts of TP ranks other than 0 (`norm-missing-experts`) or over this rank's gradients only (`global-norm`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from moebench.libraries.megatron import standins, step
from moebench.libraries.megatron.reference import Reference
from moebench.libraries.spec import Row
from moebench.parity.diagnosis import (
    AUX_LOSS_SCALE,
    CLIP_NORM_WITHOUT_GROUP,
    EXPERT_DP_UNREDUCED,
    EXPERT_GRAD_SCALE,
    EXPERTS,
    INPUT_GRAD,
    NORM_MISSING_EXPERTS,
    OUTPUT,
    REPLICATED,
    ROUTER,
    VACUOUS_ROW,
    make,
)

STEPS = 2
AUX_WHERE = ("TopKRouter.attach_and_log_load_balancing_loss / apply_z_loss: under calculate_per_token_loss the aux "
             "and z losses are scaled by the local token count, without the TP x CP factor that "
             "finalize_model_grads' division by the global token count takes out")
EDP_WHERE = "DistributedDataParallel: the expert buffers' all-reduce over the expert-data-parallel group"
NORM_WHERE = ("the optimizer's get_main_grads_for_grad_norm: an expert parameter counted as a TP duplicate on TP "
              "ranks other than 0")


def group_of(unit: str) -> str:
    return ROUTER if unit == "router" else EXPERTS if unit.startswith("expert") else REPLICATED


def run(ctx, row: Row, opts) -> list:
    """The row on this rank (in_row)."""
    with in_row():
        return _run(ctx, row.settings.fields(), opts)


@contextlib.contextmanager
def in_row():
    """What a Megatron row runs inside, on its rank: the stand-ins (standins.py), Megatron's torch.compile'd functions
    eager (TORCH_COMPILE), its import and deprecation warnings and its log lines below ERROR off the console, and
    initialize_model_parallel undone at the end."""
    import logging
    import warnings

    import torch

    logger = logging.getLogger("megatron")
    level = logger.level
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        logger.setLevel(logging.ERROR)
        stack.callback(logger.setLevel, level)
        stack.enter_context(standins.in_rank())
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.callback(step.teardown)
        yield


def rank_table(ranks: dict[str, int]) -> list[dict[str, int]]:
    """Every rank's tp, etp, ep, dp and edp ranks (all-gathered)."""
    import torch.distributed as dist

    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, ranks)
    return table


def _run(ctx, settings: dict, opts) -> list:
    import torch
    import torch.distributed as dist

    from moebench.parity.compare import STRICT, STRICT_ADAM, assertion, compare, of_terms
    from moebench.parity.layout import ExpertLayout

    r, w, seed = ctx.rank, ctx.world_size, opts.seed
    mrun = step.build(settings, seed, w)
    sizes, ranks = mrun.sizes, mrun.ranks
    table = rank_table(ranks)
    ref = Reference(settings, step.initial_values(settings, seed), seq=step.SEQ, micro=step.MICRO, lr=step.LR,
                    betas=step.ADAM_BETAS, eps=step.ADAM_EPS, weight_decay=step.WEIGHT_DECAY, clip=step.CLIP)
    out: list = []
    expected_local = ExpertLayout(step.NUM_EXPERTS, sizes["ep"]).experts_of(ranks["ep"])
    out.append(assertion(f"local experts are {expected_local[0]}-{expected_local[-1]} (contiguous over the EP ranks)",
                         list(mrun.local_experts) == list(expected_local), rank=r, group=EXPERTS,
                         note=f"Megatron's local_expert_indices: {mrun.local_experts}"))
    distopt = settings["distributed_optimizer"]
    for k in range(STEPS):
        tag = f"step {k + 1}"
        x_all, t_all = step.batch(settings, seed, k, w)
        before = {name: v.detach().clone() for name, v in ref.params.items()}
        bias_before = None if ref.expert_bias is None else ref.expert_bias.clone()
        rec = step.train_step(mrun, seed, k, w)
        res = ref.step(x_all, t_all, sizes["tp"], sizes["dp"])

        def mine(t):
            return step.chunk(t, ranks["tp"], ranks["dp"], sizes["tp"])

        out.append(compare(f"{tag}: output", rec.output, mine(res.output), STRICT, rank=r, world_size=w,
                           group=OUTPUT))
        total = torch.tensor([rec.loss], dtype=torch.float64)
        dist.all_reduce(total)
        tokens = step.SEQ * step.MICRO * sizes["dp"]
        out.append(compare(f"{tag}: loss (mean over the global batch of <output, target>)", total / tokens,
                           torch.tensor([res.loss]), of_terms(STRICT, res.main_terms), rank=r, world_size=w,
                           group=OUTPUT))
        if k == 0:
            _premises(out, settings, res, r)
        wrong = Wrong(ref, before, bias_before, settings, sizes, ranks, table, x_all, t_all) if k == 0 else None
        if not distopt:
            for name, held in mrun.held.items():
                for piece in held:
                    expected = res.grads[piece.unit][piece.index]
                    actual = piece.view(rec.grads[name])
                    what = f"{tag}: grad {piece.unit}{_rows(piece)} ({name})"
                    c = compare(what, actual, expected, STRICT, rank=r, world_size=w, group=group_of(piece.unit))
                    if not c.passed and wrong is not None:
                        alternatives = wrong.grad_alternatives(piece)
                        c = compare(what, actual, expected, STRICT, rank=r, world_size=w, group=group_of(piece.unit),
                                    alternatives=alternatives)
                        zero_as_known(c, actual, alternatives)
                    out.append(c)
        if rec.grad_norm is not None:
            what = f"{tag}: gradient norm (Megatron's optimizer, clip_grad {step.CLIP:g})"
            c = compare(what, torch.tensor([rec.grad_norm]), torch.tensor([res.grad_norm]), STRICT, rank=r,
                        world_size=w, group=REPLICATED)
            if not c.passed and wrong is not None:
                c = compare(what, torch.tensor([rec.grad_norm]), torch.tensor([res.grad_norm]), STRICT, rank=r,
                            world_size=w, group=REPLICATED, alternatives=wrong.norm_alternatives(res.grads))
            out.append(c)
        scale = tokens if settings.get("per_token") else sizes["dp"]
        what = f"{tag}: input grad (x {scale}: this rank's loss is {'a sum' if scale == tokens else 'its mean'})"
        c = compare(what, rec.input_grad, mine(res.input_grad) * scale, STRICT, rank=r, world_size=w,
                    group=INPUT_GRAD)
        if not c.passed and wrong is not None:
            c = compare(what, rec.input_grad, mine(res.input_grad) * scale, STRICT, rank=r, world_size=w,
                        group=INPUT_GRAD, alternatives=wrong.input_alternatives(mine, scale))
        out.append(c)
        if res.expert_bias is not None:
            out.append(compare(f"{tag}: router expert_bias after its update", rec.expert_bias, res.expert_bias,
                               STRICT, rank=r, world_size=w, group=ROUTER))
        for name, held in mrun.held.items():
            for piece in held:
                out.append(compare(f"{tag}: {piece.unit}{_rows(piece)} after Adam ({name})",
                                   piece.view(rec.params[name]), res.values[piece.unit][piece.index], STRICT_ADAM,
                                   rank=r, world_size=w, group=group_of(piece.unit)))
    return out


def zero_as_known(c, actual, alternatives: dict) -> None:
    """A gradient that is exactly zero where the reference's is not is diagnosed `zero` before any known-wrong answer
    is tried; when a known-wrong answer is zero there too (an expert none of this rank's tokens reached, under a
    reduction that keeps only this rank's share), name that mechanism instead."""
    from moebench.parity.diagnosis import ZERO

    if c.diagnosis is None or c.diagnosis["name"] != ZERO or bool(actual.abs().max() > 0):
        return
    for label, (value, what, name, cause) in alternatives.items():
        if not bool(value.abs().max() > 0):
            c.diagnosis = make(name, f"is exactly zero, as {what} gives: {cause}", alternative=label)
            return


def _rows(piece) -> str:
    return step.slice_label(piece.index)


def _premises(out: list, settings: dict, res, r: int) -> None:
    """What makes the row's feature count: its clip binds at step 1, its capacity drops routes."""
    from moebench.parity.compare import assertion

    binds = assertion(f"the clip binds at step 1: the reference's norm {res.grad_norm:.4g} > clip_grad {step.CLIP:g}",
                      res.clip_coeff < 1.0, rank=r, group=REPLICATED)
    if not binds.passed:
        binds.diagnosis = make(VACUOUS_ROW, "the row's premise fails: its clip does not bind")
    out.append(binds)
    if settings.get("capacity") is not None and not settings.get("pad"):
        drops = assertion(f"the capacity (factor {settings['capacity']:g}) drops routes at step 1: {res.dropped}",
                          res.dropped > 0, rank=r, group=ROUTER)
        if not drops.passed:
            drops.diagnosis = make(VACUOUS_ROW, "the row's premise fails: its capacity drops nothing")
        out.append(drops)


class Wrong:
    """Known-wrong answers at step 1, from the reference's values before the step: what each mechanism would give."""

    def __init__(self, ref: Reference, before: dict, bias_before, settings: dict, sizes: dict, ranks: dict,
                 table: list, x_all, t_all):
        self.ref, self.before, self.s, self.sizes, self.ranks, self.table = ref, before, settings, sizes, ranks, table
        self.bias_before = bias_before
        self.x_all, self.t_all = x_all, t_all
        self._cache: dict[str, Any] = {}

    def _grads(self, key: str, **variant):
        if key not in self._cache:
            with _values(self.ref, self.before, self.bias_before):
                self._cache[key] = self.ref.gradients(self.x_all, self.t_all, self.sizes["tp"], self.sizes["dp"],
                                                      **variant)
        return self._cache[key]

    def _aux_variant(self) -> bool:
        return bool(self.s.get("aux") or self.s.get("z")) and self.sizes["tp"] > 1

    def grad_alternatives(self, piece) -> dict[str, Any]:
        alts: dict[str, Any] = {}
        if piece.unit.startswith("expert"):
            _, grads = self._grads("right")
            ep = self.sizes["ep"]
            if ep > 1:
                alts["expert gradients x ep_size"] = (
                    grads[piece.unit][piece.index] * ep, f"expert gradients x ep_size ({ep})", EXPERT_GRAD_SCALE,
                    f"expert gradients {ep} x too large: each already sums over the {ep} expert-parallel ranks' "
                    "tokens (the all-to-all's backward brought them) and was divided by the expert-DP size, not the "
                    "DP size (expert_gradient_scaling_factor)")
            if self.sizes["edp"] > 1 and ep > 1:
                own = {(t["dp"], t["tp"]) for t in self.table if t["edp"] == self.ranks["edp"]}
                _, local = self._grads(f"chunks{sorted(own)}", only=own)
                alts["this expert-DP replica's own tokens"] = (
                    local[piece.unit][piece.index], "this expert-DP replica's own tokens' share", EXPERT_DP_UNREDUCED,
                    f"the expert gradients are never reduced over the {self.sizes['edp']} expert-data-parallel "
                    f"replicas ({EDP_WHERE})")
            elif self.sizes["edp"] > 1:  # EP = 1: Megatron marks experts allreduce=True, as dense parameters
                dense = {(t["dp"], t["tp"]) for t in self.table if t["tp"] == self.ranks["tp"]}
                _, grads_dp = self._grads(f"chunks{sorted(dense)}", only=dense)
                alts["reduced over the dense DP group"] = (
                    grads_dp[piece.unit][piece.index], "the share of the tokens of this rank's dense DP group",
                    EXPERT_DP_UNREDUCED, f"the expert gradients are reduced over the dense data-parallel group "
                    f"({self.sizes['dp']} rank(s), as a dense parameter's: `allreduce` left True with EP = 1) "
                    f"instead of the {self.sizes['edp']} expert-data-parallel replicas")
        if piece.unit == "router" and self._aux_variant():
            _, grads = self._grads("aux", aux_factor=1.0 / self.sizes["tp"])
            alts["aux and z losses x 1/TP"] = (
                grads[piece.unit][piece.index], f"the aux / z-loss share x 1/{self.sizes['tp']} (the TP size)",
                AUX_LOSS_SCALE, AUX_WHERE)
        return alts

    def input_alternatives(self, mine, scale) -> dict[str, Any]:
        if not self._aux_variant():
            return {}
        x_grad, _ = self._grads("aux", aux_factor=1.0 / self.sizes["tp"])
        return {"aux and z losses x 1/TP": (mine(x_grad) * scale, f"the aux / z-loss share x 1/{self.sizes['tp']}",
                                            AUX_LOSS_SCALE, AUX_WHERE)}

    def norm_alternatives(self, grads: dict) -> dict[str, Any]:
        """Norms a wrong clip could take: without any expert, without the experts of TP ranks other than 0, over
        this rank's own expert slices only, with the experts x ep_size."""
        import torch

        from moebench.parity.diagnose import per_rank_norm, scaled_experts_norm

        sq = {u: float(g.double().square().sum()) for u, g in grads.items()}
        experts = sum(v for u, v in sq.items() if u.startswith("expert"))
        dense = sum(sq.values()) - experts
        etp = self.sizes["etp"]

        def held_by(rows):
            tot = 0.0
            for e, rank in rows:
                f = step.FFN // etp
                sl = slice(rank * f, (rank + 1) * f)
                tot += float(grads[f"expert{e}.gate"][sl].double().square().sum())
                tot += float(grads[f"expert{e}.up"][sl].double().square().sum())
                tot += float(grads[f"expert{e}.down"][:, sl].double().square().sum())
            return tot

        from moebench.parity.layout import ExpertLayout

        layout = ExpertLayout(step.NUM_EXPERTS, self.sizes["ep"])
        tp0 = {(e, t["etp"]) for t in self.table if t["tp"] == 0 for e in layout.experts_of(t["ep"])}
        own = {(e, self.ranks["etp"]) for e in layout.experts_of(self.ranks["ep"])}
        total = dense + experts
        alts: dict[str, Any] = {
            "the norm without the experts": (torch.tensor([math.sqrt(dense)]), "the norm without the expert gradients",
                                             CLIP_NORM_WITHOUT_GROUP, "the expert optimizer's gradients left out of "
                                             "the norm the clip uses")}
        missing = dense + held_by(tp0)
        if abs(missing - total) > 1e-6 * total:
            alts["the norm without the experts of TP ranks > 0"] = (
                torch.tensor([math.sqrt(missing)]), "the norm over the experts held by TP rank 0 only",
                NORM_MISSING_EXPERTS, NORM_WHERE)
        local = dense + held_by(own)
        if abs(local - total) > 1e-6 * total:
            alts["a per-rank norm"] = per_rank_norm(torch.tensor([math.sqrt(local)]), "Megatron's grad norm")
        if self.sizes["ep"] > 1:
            ep = self.sizes["ep"]
            alts["experts x ep_size"] = scaled_experts_norm(torch.tensor([math.sqrt(dense + ep * ep * experts)]), ep)
        return alts


@contextlib.contextmanager
def _values(ref: Reference, values: dict, bias):
    """The reference's parameters and expert bias set to `values` and `bias` for a while (the known-wrong gradients
    are taken at step 1's)."""
    import torch

    saved = {n: v.detach().clone() for n, v in ref.params.items()}
    saved_bias = ref.expert_bias
    with torch.no_grad():
        for n, v in ref.params.items():
            v.copy_(values[n])
    ref.expert_bias = bias
    try:
        yield
    finally:
        ref.expert_bias = saved_bias
        with torch.no_grad():
            for n, v in ref.params.items():
                v.copy_(saved[n])
