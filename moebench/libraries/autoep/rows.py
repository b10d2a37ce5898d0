"""The AutoEP rows: each row's settings (its JSON fields) and the matrix at one world size.

The full cartesian product (4 families x ZeRO 0/1/2 x every autoep_size x {plain, clip, accumulation 2} x top-1/2,
and the precisions, layouts and optimizers) is ~150 rows at W = 4; a row is ~1 s there, so the matrix is a covering
subset (docs/libraries/autoep.md times it), chosen by what each axis exercises:
- the engine grid: ZeRO stage x autoep_size x {plain, clip, accumulation} is where DeepSpeed reduces, partitions
  and clips the expert gradients, so it runs whole, on one family (Mixtral, top-2);
- the routing grid: family x top-1/top-2 changes what AutoEP routes and how it maps the family's router and
  shared experts, not how the engine reduces, so it runs plain at autoep_size = W: on every ZeRO stage at W = 2,
  and above on one stage per (family, top-k), rotating so that each top-k meets every stage (at W = 4 the whole
  grid would be 21 rows, ~25 s of the 90 s budget, for what W = 2 already crosses);
- clipping and accumulation once per other family (clip at ZeRO 0 and 1, accumulation at ZeRO 2): that each
  family's shared experts and router are counted in the norm and in the accumulation;
- bf16 (noise model) per family at ZeRO 1, and on Mixtral at ZeRO 0 and 2;
- use_data_before_expert_parallelism at every ZeRO stage where the layout differs (autoep_size < W; at W = 2 it
  cannot, so one row there shows it is accepted);
- the optimizers: a config-built SGD with `model_parameters=model.parameters()` is every other row's; a client
  SGD instance at each ZeRO stage (ZeRO 1/2 refuse it: refusal rows with DeepSpeed's reason), a client callable
  and the config-built SGD with the parameters listed before initialize at ZeRO 0 and 1;
- AutoEP as shipped (no shim), once.
"""

from __future__ import annotations

import dataclasses

from moebench.libraries.autoep import compat
from moebench.libraries.autoep.shape import CLIP, EXPERTS, FAMILIES, SEQS, STEPS
from moebench.libraries.spec import Row, Settings

NAME = "autoep"
KIND = "autoep"
"""The row kind every AutoEP row is run by (run.py)."""
HALF_PRECISIONS = ("bf16",)
"""The low precisions the matrix runs, judged by the noise model. fp16 plugs in here (with its config section in
rowmath.engine_config and DeepSpeed's CPU fp16 support: the DeepSpeed fp16 work of issue 31)."""
PRECISIONS = ("fp32", *HALF_PRECISIONS)
OPTIMIZERS = ("config", "config-list", "client", "callable")
FEATURES = {"clip": "clip", "grad-accum": "accum 2"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoEPSettings(Settings):
    """One AutoEP row's settings (these names are the row's JSON fields)."""

    family: str
    """The Hugging Face model family (rowmath.FAMILIES), built from a tiny config."""
    zero_stage: int
    autoep_size: int
    """expert_parallel.autoep_size: ranks the experts are spread over (divides W); W / autoep_size ranks hold each."""
    top_k: int = 2
    grad_accum: int = 1
    clip: float = 0.0
    precision: str = "fp32"
    data_before_expert: bool = False
    """use_data_before_expert_parallelism: the expert-parallel groups are strided over the ranks."""
    optimizer: str = "config"
    """"config" (SGD built by DeepSpeed from the config, model_parameters=model.parameters()), "config-list" (the
    same with the parameters listed before initialize), "client" (a torch SGD instance), "callable" (a function
    DeepSpeed calls with the parameters after the replacement): rowmath.client_optimizer."""
    transformers: str = ""
    """The transformers release the row runs with (DeepSpeed's is the row's `version`)."""
    transformers_shim: str = ""
    """One line naming the shim the row runs with ("" : AutoEP as shipped)."""
    steps: int = STEPS
    loss_multiplier: float = 1.0
    """The loss is multiplied by this, engine and reference alike (how a user's large gradient_clipping binds)."""
    num_experts: int = EXPERTS
    """Routed experts the row's model has (a --hf-config row: its file's)."""
    seqs: int = SEQS
    """Sequences in each rank's micro-batch (a --hf-config row grows it with its experts: user_config.seqs_for)."""
    hf_config: str = ""
    """A --hf-config row: its config.json's absolute path (every rank reads it again); "": the tiny family config."""
    hf_sha256: str = ""
    norm_topk_prob: bool = False
    """A --hf-config row: the file's norm_topk_prob (at top-1 the router then gets no gradient: rowmath)."""
    aux_loss: bool = False
    """A --hf-config row: the file's output_router_logits (the model's loss adds its load-balancing loss)."""
    """The first 16 hex digits of that file's sha256 (a rank refuses the file if it changed since)."""

    def features(self) -> tuple[str, ...]:
        out = []
        if self.top_k == 1:
            out.append("top-1")
        if self.clip > 0:
            out.append("clip")
        if self.grad_accum > 1:
            out.append("grad-accum")
        if self.precision != "fp32":
            out.append(self.precision)
        if self.data_before_expert:
            out.append("data-before-expert")
        if self.optimizer != "config":
            out.append(f"{self.optimizer}-optimizer")
        if compat.needs_shim(self.transformers) and not self.transformers_shim:
            out.append("as-shipped")
        return tuple(out)


def ep_sizes(world_size: int) -> list[int]:
    """Every autoep_size > 1 dividing W, largest first (1 is no expert parallelism)."""
    return [ep for ep in range(world_size, 1, -1) if world_size % ep == 0]


def _release_fields(tf_version: str | None) -> dict:
    return {"transformers": tf_version or "?",
            "transformers_shim": compat.shim_line(tf_version) if compat.needs_shim(tf_version) else ""}


def matrix(world_size: int, tf_version: str | None) -> list[AutoEPSettings]:
    """The default matrix at `world_size` (the module docstring says how it was chosen)."""
    if world_size < 2:
        return []
    release = _release_fields(tf_version)
    base = dict(zero_stage=0, autoep_size=world_size, **release)
    out = []
    for stage in (0, 1, 2):  # the engine grid
        for ep in ep_sizes(world_size):
            plain = AutoEPSettings(family="mixtral", **{**base, "zero_stage": stage, "autoep_size": ep})
            out += [plain, dataclasses.replace(plain, clip=CLIP), dataclasses.replace(plain, grad_accum=2)]
    for i, family in enumerate(FAMILIES):  # the routing grid (whole at W = 2, one rotating stage above)
        for j, top_k in enumerate((2, 1)):
            stages = (0, 1, 2) if world_size == 2 else ((i + j) % 3,)
            out += [AutoEPSettings(family=family, top_k=top_k, **{**base, "zero_stage": stage}) for stage in stages
                    if (family, top_k) != ("mixtral", 2)]
    for family in FAMILIES[1:]:
        out += [AutoEPSettings(family=family, clip=CLIP, **base),
                AutoEPSettings(family=family, clip=CLIP, **{**base, "zero_stage": 1}),
                AutoEPSettings(family=family, grad_accum=2, **{**base, "zero_stage": 2})]
    for family in FAMILIES:
        for stage in ((0, 1, 2) if family == "mixtral" else (1,)):
            out.append(AutoEPSettings(family=family, precision="bf16", **{**base, "zero_stage": stage}))
    strided = [ep for ep in ep_sizes(world_size) if ep < world_size]
    for stage in ((0, 1, 2) if strided else (1,)):
        out.append(AutoEPSettings(family="mixtral", data_before_expert=True,
                                  **{**base, "zero_stage": stage, "autoep_size": (strided or [world_size])[0]}))
    out += [AutoEPSettings(family="mixtral", optimizer="client", **{**base, "zero_stage": s}) for s in (0, 1, 2)]
    out += [AutoEPSettings(family="mixtral", optimizer=o, **{**base, "zero_stage": s})
            for o in ("callable", "config-list") for s in (0, 1)]
    if compat.needs_shim(tf_version):  # AutoEP as shipped: the incompatibility, a finding of its own
        out.append(dataclasses.replace(out[0], transformers_shim=""))
    return out


def user_matrix(world_size: int, user: dict, tf_version: str | None) -> list[AutoEPSettings]:
    """--ds-config: every family at autoep_size = W (or the file's autoep_size, when it divides W) with the user's
    ZeRO stage, clipping, accumulation, precision and data-before-expert layout. With --hf-config (user["model"]):
    the file's family, experts and top-k instead of the tiny families (user_config.model_rows); autoep_size must
    also divide the experts."""
    if world_size < 2:
        return []
    model = user.get("model")
    experts = model["num_experts"] if model else EXPERTS
    ep = user.get("autoep_size") or world_size
    fits = [e for e in ep_sizes(world_size) if experts % e == 0] or [world_size]  # largest first
    ep = ep if ep > 1 and world_size % ep == 0 and experts % ep == 0 else fits[0]
    fields = dict(zero_stage=user["zero_stage"], autoep_size=ep, clip=user["clip"], grad_accum=user["grad_accum"],
                  precision=user["precision"], data_before_expert=bool(user.get("data_before_expert")),
                  loss_multiplier=user.get("loss_multiplier", 1.0), **_release_fields(tf_version))
    if model is None:
        return [AutoEPSettings(family=family, **fields) for family in FAMILIES]
    from moebench.libraries.autoep.user_config import seqs_for

    mine = AutoEPSettings(family=model["model_type"], top_k=model["top_k"], num_experts=experts,
                          seqs=seqs_for(experts, model["top_k"]), hf_config=model["path"],
                          hf_sha256=model["sha256"], norm_topk_prob=bool(model.get("norm_topk_prob")),
                          aux_loss=bool(model.get("aux_loss")), **fields)
    # bf16: its float32 twin too, judged per element (the bf16 row is judged by the noise model)
    return [mine] + ([dataclasses.replace(mine, precision="fp32")] if mine.precision != "fp32" else [])


def row_of(s: AutoEPSettings, world_size: int, *, variant: str | None = None, note: str = "") -> Row:
    """The Row of one setting: key autoep/<family>/zero<S>/ep=<E>/w<W>[/<features>]."""
    features = s.features()
    return Row(library=NAME, model=s.family, backend=f"zero{s.zero_stage}", ep_mode=f"ep={s.autoep_size}",
               world_size=world_size, kind=KIND, features=features, settings=s,
               variant="+".join(features) if variant is None else variant, note=note)
