"""Megatron-core: its MoE layer (TopKRouter, the all-to-all and all-gather token dispatchers, SequentialMLP and
GroupedMLP experts, SharedExpertMLP) from the layer spec Megatron's GPT models use, trained through its own
DistributedDataParallel, finalize_model_grads and optimizer (Adam with clipping) over gloo ranks on CPU, with
TP / EP / ETP / expert-data-parallel from `initialize_model_parallel`, against the same mathematics on one process.

The rows run on CPU through a handful of stand-ins for CUDA calls (streams, `current_device`, "cuda" tensors, the
dispatcher's split sizes, 0.16.1's missing `te_general_gemm`, the grouped_gemm extension, triton at import), all in
standins.py, in the rank processes only, recorded in every row (`standins`, `triton`). Transformer Engine's experts
and the flex dispatcher (DeepEP / HybridEP) need CUDA kernels: skip rows with the reason.

The package's files: __init__.py the adapter (the matrix, what cannot run here, the releases); api.py the release
differences; standins.py every stand-in; step.py what a row builds and runs on a rank (Megatron's own objects);
reference.py the one-process mathematics; parity.py the float32 rows' comparisons and known-wrong answers; bf16.py
the bf16 rows' noise-model judgement; repro.py and repro_main.py the --repro script; loaded.py the parent's import.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from moebench.libraries.megatron import api
from moebench.libraries.megatron.releases import COMPATIBILITY
from moebench.libraries.spec import BF16, PARITY, Adapter, Row, Settings

NAME = "megatron"
TORCH_COMPILE = ("force_eager: Megatron's jit_fuser (torch.compile) functions run as plain torch in the ranks (the "
                 "same mathematics; compiling them costs seconds a rank a row)")
PRELOAD = ("moebench.libraries.megatron.loaded",)
"""Imports megatron-core's modules once in the parent (~3 s), warnings silenced; the ranks fork from it."""


@dataclasses.dataclass(frozen=True)
class Model:
    """A row's router and shared expert, in Megatron's TransformerConfig terms."""

    score: str
    pre_softmax: bool = False
    topk: int = 2
    groups: int | None = None
    group_topk: int | None = None
    scaling: float | None = None
    shared: int | None = None
    shared_gate: bool = False
    expert_bias: float | None = None


MODELS = {
    "softmax-top2": Model("softmax"),
    "softmax-pre-top2": Model("softmax", pre_softmax=True),
    "sigmoid-grouped+shared": Model("sigmoid", groups=4, group_topk=2, scaling=2.5, shared=api.SHARED_FFN,
                                    shared_gate=True),
    "sigmoid-bias": Model("sigmoid", groups=4, group_topk=2, expert_bias=0.01),
}
"""Mixtral-style (softmax over the top-2 logits); softmax before the top-2; DeepSeek-V3-style (sigmoid, 4 expert groups
of which 2 are kept, a scale, a shared expert with its sigmoid gate); aux-loss-free balancing (sigmoid, groups, the
expert bias updated by finalize_model_grads)."""

FEATURES = {
    "": {},
    "aux+z": {"aux": 1e-2, "z": 1e-3},
    "aux+z+per-token": {"aux": 1e-2, "z": 1e-3, "per_token": True},
    "capacity-drop": {"capacity": 0.5},
    "capacity-pad": {"capacity": 1.0, "pad": True},
    "distopt": {"distributed_optimizer": True},
    "bf16": {"precision": "bf16"},
}
"""A row's variant -> its settings beyond the model: aux loss (Switch, 1e-2) and z-loss (1e-3), the per-token loss
(calculate_per_token_loss), a capacity that drops routes (factor 0.5) or pads every expert to it (1.0), Megatron's
distributed optimizer, bf16."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronSettings(Settings):
    dispatcher: str
    """moe_token_dispatcher_type: "alltoall" or "allgather"."""
    experts: str
    """"sequential" (SequentialMLP) or "grouped" (GroupedMLP, moe_grouped_gemm)."""
    tp: int
    etp: int
    ep: int
    edp: int
    """Expert data-parallel size: world / (etp x ep)."""
    score: str
    pre_softmax: bool
    topk: int
    groups: int | None = None
    group_topk: int | None = None
    scaling: float | None = None
    shared: int | None = None
    shared_gate: bool = False
    expert_bias: float | None = None
    """moe_router_bias_update_rate (None: no expert bias)."""
    capacity: float | None = None
    pad: bool = False
    aux: float | None = None
    z: float | None = None
    per_token: bool = False
    precision: str = "fp32"
    distributed_optimizer: bool = False
    standins: str = ""
    """The CUDA stand-ins the ranks run with (standins.STANDINS)."""
    triton: str = ""
    """The triton megatron-core imports with: installed, the import stand-in, or "" (this release imports none)."""
    torch_compile: str = TORCH_COMPILE


def layouts(world_size: int) -> dict[str, tuple[int, int, int]]:
    """EP mode label -> (tp, etp, ep) at `world_size`: EP = W; EP < W with expert data parallel; TP = 2 with ETP = TP
    (EP = 1; and EP = W/2 from 4 ranks) and with ETP = 1 (EP over the TP ranks, EP = 1 with expert data parallel,
    and EP = W/2 from 4 ranks). Labels join with "_", never ",": --row takes a comma-separated list of keys."""
    if world_size < 2 or world_size % 2:
        return {}
    w = world_size
    out = {f"ep={w}": (1, 1, w), f"ep={w // 2}_edp=2": (1, 1, w // 2), "tp=2_ep=1": (2, 2, 1),
           f"tp=2_etp=1_ep={w}": (2, 1, w), "tp=2_etp=1_ep=1": (2, 1, 1)}
    if w >= 4:
        out.update({f"tp=2_ep={w // 2}": (2, 2, w // 2), f"tp=2_etp=1_ep={w // 2}": (2, 1, w // 2)})
    return out


def matrix(world_size: int) -> list[tuple[str, str, str, str]]:
    """(model, backend, EP mode, variant) of every row at `world_size`; backend = dispatcher+experts."""
    lay = list(layouts(world_size))
    if not lay:
        return []
    ep_w, ep_half, tp_etp, tp_ep, tp_edp = lay[:5]
    a2a, ag = "alltoall+sequential", "allgather+sequential"
    rows = [("softmax-top2", a2a, mode, "") for mode in lay]
    rows += [("softmax-top2", ag, mode, "") for mode in (ep_w, ep_half, tp_etp, *lay[5:6])]
    rows += [("softmax-pre-top2", a2a, ep_w, ""), ("sigmoid-grouped+shared", a2a, ep_w, ""),
             ("sigmoid-grouped+shared", a2a, tp_etp, ""), ("sigmoid-grouped+shared", ag, tp_ep, ""),
             ("sigmoid-bias", a2a, ep_w, ""), ("sigmoid-bias", a2a, tp_ep, "")]
    rows += [("softmax-top2", a2a, ep_w, "capacity-drop"), ("softmax-top2", a2a, ep_w, "capacity-pad"),
             ("softmax-top2", ag, ep_w, "capacity-drop")]
    rows += [("softmax-top2", a2a, mode, variant) for variant in ("aux+z", "aux+z+per-token")
             for mode in (ep_w, tp_etp, tp_ep)]
    rows += [("softmax-top2", a2a, mode, "distopt") for mode in (ep_w, ep_half, tp_ep)]
    rows += [("softmax-top2", a2a, mode, "bf16") for mode in (ep_w, tp_ep)]
    rows += [("softmax-top2", "alltoall+grouped", mode, "bf16") for mode in (ep_w, tp_ep)]
    rows += [("softmax-top2", "flex+sequential", ep_w, ""), ("softmax-top2", "alltoall+te", ep_w, "")]
    return rows


def make_row(model: str, backend: str, ep_mode: str, world_size: int, variant: str = "") -> Row:
    from moebench.libraries.megatron.standins import STANDINS, triton_kind

    spec = MODELS[model]
    dispatcher, experts = backend.split("+")
    tp, etp, ep = layouts(world_size).get(ep_mode, (1, 1, world_size))
    extra = FEATURES[variant]
    settings = MegatronSettings(dispatcher=dispatcher, experts=experts, tp=tp, etp=etp, ep=ep,
                                edp=world_size // (etp * ep), **dataclasses.asdict(spec), **extra, standins=STANDINS,
                                triton=triton_kind())
    kind = BF16 if extra.get("precision") == "bf16" else PARITY
    features = tuple(f for f in variant.split("+") if f) or ()
    return Row(library=NAME, model=model, backend=backend, ep_mode=ep_mode, world_size=world_size, kind=kind,
               settings=settings, features=features, variant=variant)


class Megatron(Adapter):
    """Megatron-core's MoE through its DDP, finalize_model_grads and optimizer (see the module docstring)."""

    name = NAME
    compatibility = COMPATIBILITY
    import_name = "megatron.core"
    dist_name = "megatron-core"
    extra = "megatron"
    catches = ("a Megatron-core EP / TP / ETP path (its dispatcher, its DDP and finalize_model_grads, its aux-loss "
               "scaling, its clip norm, its optimizer) whose outputs, gradients or weights differ from one process")
    preload = PRELOAD
    runners = {PARITY: "moebench.libraries.megatron.parity:run", BF16: "moebench.libraries.megatron.bf16:run"}
    timeout_s = 120.0

    def version(self) -> str | None:
        return api.mc_version()

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("megatron") is None or api.mc_version() is None:
            return f"not installed: {self.install_hint()}"
        if not api.has_moe():
            return f"megatron-core {api.mc_version()} has no transformer/moe (its MoE layer)"
        return None


    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        return [make_row(model, backend, mode, world_size, variant)
                for model, backend, mode, variant in matrix(world_size)]

    def skip_reason(self, row: Row) -> str | None:
        return skip_reason(row)

    def repro_script(self, row: Row, seed: int) -> str | None:
        from moebench.libraries.megatron import repro

        return repro.script(row, seed)


def skip_reason(row: Row) -> str | None:
    """One line why this row cannot run here, or None."""
    s = row.settings
    if not isinstance(s, MegatronSettings) or row.model not in MODELS:
        return f"unknown megatron row {row.key()}"
    if s.dispatcher == "flex":
        return ("the flex dispatcher runs DeepEP or HybridEP kernels (fused_a2a.py), which need CUDA GPUs; "
                "without them Megatron refuses it")
    if s.dispatcher == "alltoall" and s.etp > 1 and s.ep > 1:
        return ("the all-to-all dispatcher gathers over the ETP ranks with a list all_gather of uneven sizes "
                "(gather_from_sequence_parallel_region, output_split_sizes), which gloo refuses "
                "(ProcessGroupGloo::allgather: invalid tensor size)")
    if s.experts == "te":
        return "TEGroupedMLP needs Transformer Engine and a CUDA GPU (not installed here; its spec is TE's)"
    if row.world_size < 2 or row.world_size % s.tp or row.world_size % (s.etp * s.ep) or api.NUM_EXPERTS % s.ep:
        return f"{api.NUM_EXPERTS} experts / this layout do not fit {row.world_size} ranks"
    missing = api.lacks(s.fields())
    if missing:
        return f"megatron-core {api.mc_version()}'s TransformerConfig has no {', '.join(missing)}"
    if s.experts == "grouped" and not api.has_grouped_mlp():
        return (f"megatron-core {api.mc_version()} has no GroupedMLP (its grouped experts are TEGroupedMLP, which "
                "needs Transformer Engine)")
    return None


ADAPTER = Megatron()
