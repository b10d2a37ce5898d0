"""Every diagnosis name moebench gives, and the Diagnosis record that carries one.

A diagnosis names the bug class behind a failed comparison or row: `name` (one of the constants below, what
`--json`'s `diagnosis_name` and the tests match), one `sentence` for a person, and `details` (JSON values) for
tools. Its JSON form is {"name", "sentence", "details"}: `Diagnosis.to_dict()`. Builders make a Diagnosis;
records (comparisons, checks, rows) carry its dict, since they cross processes and files as JSON.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# ---- from the numbers of one comparison (diagnose.py)
SHAPE = "shape"
NON_FINITE = "non-finite"
"""NaN or Inf where the reference has none, in any precision: never noise, never another mechanism."""
NONDETERMINISTIC = "nondeterministic"
"""Two runs of the same row with the same seed gave different numbers (uninitialised memory, a race): what each run
read is in the details."""
ZERO = "zero"
UNIFORM_SCALE = "uniform-scale"
"""actual = c x expected everywhere; c or 1/c an integer N names "summed instead of averaged over N ranks"."""
ROWS_PERMUTED = "rows-permuted"
PARTIAL = "partial"
"""Only some slices differ (one comparison), or only some ranks failed (a check)."""
UNEXPLAINED = "unexplained"
FAILED_ASSERTION = "failed-assertion"
"""A non-numeric assertion failed (keys, an exception, a grad_fn): its note says what broke."""

# ---- known-wrong implementations a comparison matched (diagnose.py's builders)
RANK_LOCAL = "rank-local"
MISSING_BACKWARD_EXCHANGE = "missing-backward-exchange"
SCORES_MISPAIRED = "scores-mispaired"
UNROUTED_SLOTS = "unrouted-slots"

# ---- expert-parallel mechanisms named by the frameworks' adapters (libraries/automodel, libraries/torchtitan)
ROUTER_DETACHED = "router-detached"
"""The router's gradient is exactly zero (or None) while the output is right: the routing weights reach the experts
through a non-differentiable gather (their gradient is cut on the way back)."""
GATHER_BACKWARD_UNREDUCED = "gather-backward-unreduced"
"""An all-gather whose backward returns each rank's own gradient without reducing it over the ranks: a token's input
and routing weights get gradient only through the experts of the rank that holds the token."""
GRAD_LEFT_PARTIAL = "grad-left-partial"
"""Under tensor parallelism a gradient left Partial: each TP rank holds its shard's share, the sum over the TP ranks is
right (a dropped gradient placement: a to_local / local_map without grad_placements=Partial)."""

# ---- an engine's first divergence (libraries/deepspeed/mechanisms.py)
VACUOUS_ROW = "vacuous-row"
"""The row's premise fails (its clip does not bind, its capacity drops nothing)."""
FORWARD_DIFFERS = "forward-differs"
GLOBAL_NORM = "global-norm"
"""A clip coefficient from the wrong norm (an engine's, or a trainer's clip_grad_norm): e.g. a global norm from
per-rank norms, each over the experts that rank holds, never reduced over the expert-parallel ranks."""
PARTITION_COPY_BACK = "partition-copy-back"
ACCUM_BOUNDARY = "accum-boundary"
EXPERT_GRAD_SCALE = "expert-grad-scale"
LOSS_SCALE = "loss-scale"
REDUCED_GRAD_WRONG = "reduced-grad-wrong"
BF16_NOISE = "bf16-noise"
"""Half precision farther from float32 than the noise model allows, and no mechanism explains it."""
FP16_NOISE = "fp16-noise"
"""The same in fp16."""
LOSS_SCALE_NEVER_APPLIED = "loss-scale-never-applied"
"""fp16: the loss was never multiplied by the loss scale, yet the step divides by it (every update x 1/scale)."""
LOSS_SCALE_TWICE = "loss-scale-twice"
"""fp16: the loss multiplied by the loss scale twice."""
CLIP_NORM_WITHOUT_GROUP = "clip-norm-without-group"
"""Clipping by a norm that leaves out one parameter group: every update x |g| / |g without that group|."""
OVERFLOW_SKIP = "overflow-skip"
"""fp16 loss scaling skipped a step the one-process run does not overflow on, or applied one it overflows on (a
step skipped where both overflow is loss scaling's design, and passes)."""
ROUTER_DETACHED = "router-detached"
"""The router's gradient is exactly zero while the output is right: the routing weights reach the output without a
gradient path back to the router (detached, or gathered by an operation with no backward)."""
NOT_STEPPED = "not-stepped"
"""Gradients right, but the optimizer step leaves some parameters exactly unchanged: they are not in its
parameter groups (e.g. parameters a library created after the optimizer was given the model's)."""
LIBRARY_RAISED = "library-raised"
"""A rank raised inside the code under test (the library's, or a user's layer and adapter): the exception, the rank
and the file:line of the innermost frame outside moebench, torch and the standard library."""
RANK_DIED = "rank-died"
"""A rank ended without a result (killed by a signal, exited, or aborted by a fatal error)."""
HUNG = "hung"
"""The row's deadline passed with ranks still running: their stacks say where they were."""
PROTOCOL = "adapter-protocol"
"""The adapter broke its contract (a runner that returned no comparisons): what it returned and what it must."""
INCOMPATIBLE_RELEASE = "incompatible-release"
"""The library fails before training with the installed release of a library it builds on (its one line names both
versions and the call that broke), e.g. DeepSpeed's AutoEP with a transformers it was not written for."""

# ---- a resumed run's restored state (restore.py)
NOT_RESTORED = "not-restored"
PERMUTATION = "permutation"
SPLIT_RESTORE = "split-restore"
RESTORE_UNEXPLAINED = "restore-unexplained"
REFUSED = "refused"
"""The library refused what the row asked (a checkpoint load): its message."""
EMULATED_PIECE = "emulated-piece"
"""A question, never the library's bug: the failure lies where a piece the row runs in moebench's code instead of
the framework's (its FSDP's reduction, say) feeds the failing group, by a mechanism that piece could produce
(spec.Emulated). The details keep what it would otherwise be named (`was`)."""
RESTORE_NAMES = (NOT_RESTORED, PERMUTATION, SPLIT_RESTORE, RESTORE_UNEXPLAINED)

# ---- Megatron-core's gradient finalisation and optimizer (libraries/megatron)
AUX_LOSS_SCALE = "aux-loss-scale"
"""The aux-loss / z-loss share of a gradient scaled by a wrong factor while the main loss's share is right (Megatron
under TP with the per-token loss: the aux and z losses scaled by the local token count without the TP factor, so
their gradient is 1/TP of what it should be)."""
EXPERT_DP_UNREDUCED = "expert-dp-unreduced"
"""Expert gradients not reduced over the whole expert-data-parallel group (never, or over another group such as the
dense data-parallel one): each replica of an expert keeps the share of only some ranks' tokens, and the replicas
drift apart."""
NORM_MISSING_EXPERTS = "norm-missing-experts"
"""The gradient norm (the clip's) leaves out experts some ranks hold (those on tensor-parallel ranks other than 0
counted as TP duplicates), so clipping binds less than it should."""

REDUCTION_MECHANISMS = (GRAD_LEFT_PARTIAL, UNIFORM_SCALE, RANK_LOCAL, PARTIAL, REDUCED_GRAD_WRONG, EXPERT_DP_UNREDUCED,
                        BF16_NOISE, FP16_NOISE, UNEXPLAINED)
"""What a gradient reduction done wrong (missing, over another group, by a wrong factor) reads as: the diagnoses an
emulated reduction (spec.Emulated) could produce. A gradient the backward never made (router-detached), a raise or a
NaN it cannot."""

# ---- parameter groups: what a check-level diagnosis counts right and wrong ("experts wrong (3/36)")
OUTPUT = "output"
"""The forward: outputs, losses, gathered tensors."""
INPUT_GRAD = "input gradient"
ROUTER = "gate/router"
"""The gate or router: its weights, gradients, routing decisions and capacity."""
EXPERTS = "experts"
REPLICATED = "replicated"
"""Everything else: dense (data-parallel) parameters, norms, the row's own premises."""
GROUPS = (OUTPUT, INPUT_GRAD, ROUTER, EXPERTS, REPLICATED)


@dataclasses.dataclass(kw_only=True)
class Diagnosis:
    """One diagnosis: a name above, one sentence, and details (JSON values)."""

    name: str
    sentence: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form records carry."""
        return {"name": self.name, "sentence": self.sentence, "details": self.details}


def make(name: str, sentence: str, **details: Any) -> dict[str, Any]:
    """A diagnosis in its JSON form, built through the Diagnosis record."""
    return Diagnosis(name=name, sentence=sentence, details=details).to_dict()
