"""The mathematics of a DeepSpeed AutoEP row, in one place for the tool and its standalone reproduction script:
the tiny Hugging Face model of each family (built from a config, nothing downloaded), its seeded weights, the
data, the loss, the DeepSpeed config, the one-process reference step, how AutoEP's parameters map onto the
model's own (every expert by its GLOBAL index), and the transformers shim.

Over 400 lines: the repro script pastes this one file, so everything the script must rebuild (a --hf-config row's
family and shapes included) lives here, not in an import the script cannot make.

Stdlib and torch at import (transformers is imported where it is used): `--repro` pastes this file into the
script (libraries/repro), so the script and the tool build the same model from the same seed, draw the same
batches and print the same figures.
"""

import dataclasses
import math
import re

import torch

from moebench.libraries.autoep.shape import EXPERTS, FAMILIES, SEQS, STEPS  # noqa: F401 # @PASTED@ (the script pastes shape.py above)

HIDDEN = 32
FFN = 16
"""Each expert's intermediate size (and the shared experts')."""
VOCAB = 32
SEQ_LEN = 16
"""One rank's micro-batch: SEQS sequences of SEQ_LEN tokens (64 tokens: at top-1 too every expert gets tokens)."""
LR = 0.1
"""SGD's learning rate: an update (lr x gradient) stands well above the float32 rounding of the parameters."""
MLP = "model.layers.0.mlp."
"""The one MoE block's prefix in the model (AutoEP's presets match model.layers.N.mlp)."""
EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""AutoEP's grouped expert weights -> the projection they hold: gate_up_proj[:, :FFN] (w1), [:, FFN:] (w3) and
down_proj (w2) of the Hugging Face model's fused experts."""


BF16_TIE_MARGIN = 0.02
"""A token whose routing choice is within this of a tie (the k-th and (k+1)-th expert's scores, in the router's
choice units: softmax probabilities, or DeepSeek-V3's biased sigmoid scores) may be routed either way by a correct
bf16 run: bf16 moves these scores by up to 0.007 here (measured: fp32 vs bf16 on one process, every family), so a
gap under 0.02 can flip. In bf16 rows such tokens are left out of the loss (their label ignored), on every side
alike, so one legitimate flip of a near-tie cannot bend the whole gradient; the margin is read off the float32
reference, never the engine, so a routing bug still shows on every other token."""


def family_config(family: str, top_k: int, kwargs: dict | None = None):
    """The family's tiny config (one decoder layer, EXPERTS routed experts, top_k per token). At top-1 the
    Qwen3-MoE and DeepSeek-V3 rows do not normalise the routing weight (norm_topk_prob False), so their router has a
    gradient to verify (a normalised top-1 weight is s / s = 1); Mixtral always normalises (router_gets_gradient).
    `kwargs`: a --hf-config row's shrunk config (the user's config.json as transformers read it, its sizes shrunk:
    moebench.libraries.hf_config), built by transformers' own class for the family instead."""
    import transformers as hf

    if kwargs is not None:
        return hf.AutoConfig.for_model(family, **kwargs, attn_implementation="eager")

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=64,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=None,
                  attn_implementation="eager")
    if family == "mixtral":
        return hf.MixtralConfig(intermediate_size=FFN, num_local_experts=EXPERTS, **common)
    if family == "qwen3_moe":
        return hf.Qwen3MoeConfig(intermediate_size=FFN, moe_intermediate_size=FFN, num_experts=EXPERTS, head_dim=8,
                                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=top_k > 1, **common)
    if family == "qwen2_moe":  # a shared expert with its sigmoid gate beside the routed ones
        return hf.Qwen2MoeConfig(intermediate_size=FFN, moe_intermediate_size=FFN, num_experts=EXPERTS,
                                 shared_expert_intermediate_size=FFN, decoder_sparse_step=1, mlp_only_layers=[],
                                 norm_topk_prob=False, **common)
    if family == "deepseek_v3":  # sigmoid scores, 4 groups of 2 experts, 2 groups per token, a shared expert
        common["num_key_value_heads"] = common["num_attention_heads"]  # its attention has no grouped keys
        return hf.DeepseekV3Config(intermediate_size=2 * FFN, moe_intermediate_size=FFN, n_routed_experts=EXPERTS,
                                   n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=0,
                                   q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                   v_head_dim=8, routed_scaling_factor=1.5, norm_topk_prob=top_k > 1, **common)
    raise ValueError(f"unknown family {family!r}")


def n_experts(config) -> int:
    """The routed experts of a family's config (Mixtral, Qwen: num_local_experts / num_experts; DeepSeek-V3:
    n_routed_experts)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise ValueError(f"{type(config).__name__} declares no number of experts")


def router_gets_gradient(family: str, top_k: int, normalised: bool = False, aux: bool = False) -> bool:
    """False where the routing weight is normalised over a single expert (Mixtral at top-1, or a --hf-config's
    norm_topk_prob at top-1: w = s / s = 1) and no load-balancing loss reaches the router (`aux`: the config's
    output_router_logits): the router's gradient is zero in exact arithmetic and what either side computes is
    rounding."""
    return aux or not (top_k == 1 and (family == "mixtral" or normalised))


def model_class(family: str):
    import transformers as hf

    return {"mixtral": hf.MixtralForCausalLM, "qwen3_moe": hf.Qwen3MoeForCausalLM,
            "qwen2_moe": hf.Qwen2MoeForCausalLM, "deepseek_v3": hf.DeepseekV3ForCausalLM}[family]


MAX_DRAWS = 64
"""How many weight draws build() tries before it gives up on a seed (measured on seeds 0-10, every family and
top-k: at most 6 draws, DeepSeek-V3 top-1; seed 0 needs one everywhere)."""


USER_BIAS_SCALE = 0.01
"""A --hf-config row's DeepSeek-V3 score-correction bias, N(0, 0.01^2): with 128-256 experts a token's k-th and
(k+1)-th sigmoid scores are ~0.006 apart, so the bias moves many choices without deciding them all (at the default
rows' 0.1 it decides them: measured with transformers' router, 80 of 256 experts never chosen)."""


def build(family: str, top_k: int, seed: int, kwargs: dict | None = None, seqs: int = SEQS):
    """The family's model, float32, in train mode, with seeded weights: every matrix N(0, 1/fan_in) (routing and
    outputs O(1)), norms 1, DeepSeek-V3's score-correction bias N(0, 0.1^2) (so it moves the routing).
    Weights are drawn again from the same generator until every expert gets tokens on the first step's slices of
    ranks 0 and 1 (in every row's first step at any W >= 2): what every row asserts of itself (run._premises),
    chosen on this float32 model alone, never on a library's output; a few seeds need a second draw (a tiny
    random router can leave an expert unchosen by all 128 tokens, most often DeepSeek-V3's grouped routing).
    A --hf-config row (`kwargs`, its `seqs` sequences a rank) draws its router's rows at one norm (no expert favoured
    by the draw, so each of 128-256 experts gets its share) and the bias at USER_BIAS_SCALE."""
    config = family_config(family, top_k, kwargs)
    torch.manual_seed(seed)
    model = model_class(family)(config).float()
    g = torch.Generator().manual_seed(seed * 7919 + 3)
    user = kwargs is not None
    for _ in range(MAX_DRAWS):
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if not t.is_floating_point() or name.endswith("norm.weight"):
                    continue
                bias = name.endswith("e_score_correction_bias")
                scale = (USER_BIAS_SCALE if user else 0.1) if bias else t.shape[-1] ** -0.5
                drawn = torch.randn(t.shape, generator=g) * scale
                if user and name == MLP + "gate.weight":
                    drawn = drawn / drawn.norm(dim=-1, keepdim=True)
                t.copy_(drawn)
        if min(first_routes(model.train(), seed, seqs)) > 0:
            return model
    raise ValueError(f"{family} top-{top_k}: no weight draw of seed {seed} routes tokens to every expert "
                     f"in {MAX_DRAWS} draws: try another --seed")


def first_routes(model, seed: int, seqs: int = SEQS) -> list:
    """Routes per expert over the first step's first micro-batch of ranks 0 and 1."""
    experts, vocab = n_experts(model.config), model.config.vocab_size
    routes = torch.zeros(experts, dtype=torch.long)
    with torch.no_grad():
        for rank in (0, 1):
            index = forward(model, batch(seed, 0, 0, rank, seqs, vocab))[1][2]
            routes += torch.bincount(index.reshape(-1), minlength=experts)
    return routes.tolist()


def batch(seed: int, step: int, micro: int, rank: int, seqs: int = SEQS, vocab: int = VOCAB) -> torch.Tensor:
    """Rank `rank`'s token ids for optimizer step `step`, micro-step `micro` (the labels are the same ids)."""
    g = torch.Generator().manual_seed(seed * 100_003 + 1000 * step + 10 * micro + rank)
    return torch.randint(0, vocab, (seqs, SEQ_LEN), generator=g)


def loss_of(model, ids: torch.Tensor, multiplier: float = 1.0, labels: torch.Tensor | None = None) -> torch.Tensor:
    """The causal-LM loss Hugging Face computes (mean over this rank's labelled tokens; the labels are the ids
    unless given), times the row's multiplier."""
    return model(input_ids=ids, labels=ids if labels is None else labels).loss.float() * multiplier


def forward(model, ids: torch.Tensor):
    """(logits, the router's outputs, the load-balancing loss or None) of one forward: the router (`gate`) read by
    a forward hook; the auxiliary loss is the model's own (`aux_loss`, computed where its config sets
    output_router_logits)."""
    got = []
    handle = model.get_submodule(MLP + "gate").register_forward_hook(lambda module, args, out: got.append(out))
    try:
        out = model(input_ids=ids)
    finally:
        handle.remove()
    return out.logits, got[0], getattr(out, "aux_loss", None)


def hf_loss(model, logits: torch.Tensor, labels: torch.Tensor, multiplier: float = 1.0,
            aux: torch.Tensor | None = None) -> torch.Tensor:
    """The loss Hugging Face's forward computes from these logits (the model's own loss_function, plus
    router_aux_loss_coef x its load-balancing loss where the config sets output_router_logits), times the
    multiplier: what loss_of gives, from a forward already made."""
    loss = model.loss_function(logits, labels, model.config.vocab_size)
    if aux is not None and getattr(model.config, "output_router_logits", False):
        loss = loss + model.config.router_aux_loss_coef * aux.to(loss.device)
    return loss.float() * multiplier


def choice_gaps(model, router_out, family: str, top_k: int) -> torch.Tensor:
    """Per token, how far its routing choice is from a tie: the gap between the k-th and (k+1)-th expert's choice
    score (softmax probability; DeepSeek-V3: sigmoid + score-correction bias among the experts of the groups it
    picks, and half the gap between its last picked and first unpicked group, a group score being two scores).
    `router_out`: what the model's router returned (its logits first)."""
    experts = router_out[0].shape[-1]
    logits = router_out[0].detach().float().reshape(-1, experts)
    if family != "deepseek_v3":
        top = torch.softmax(logits, -1).sort(-1, descending=True).values
        return top[:, top_k - 1] - top[:, top_k]
    config, gate = model.config, model.get_submodule(MLP + "gate")
    scores = torch.sigmoid(logits) + gate.e_score_correction_bias.float()
    grouped = scores.view(-1, config.n_group, experts // config.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    ranked = group_scores.sort(-1, descending=True).values
    group_gap = (ranked[:, config.topk_group - 1] - ranked[:, config.topk_group]) / 2
    picked = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
        1, group_scores.topk(config.topk_group, -1).indices, True)
    top = grouped.masked_fill(~picked.unsqueeze(-1), float("-inf")).view(-1, experts).sort(-1, descending=True).values
    return torch.minimum(top[:, top_k - 1] - top[:, top_k], group_gap)


def tie_free_labels(ids: torch.Tensor, gaps: torch.Tensor) -> torch.Tensor:
    """The labels (the ids) with every position whose logits come from a near-tie token left out (-100, ignored
    by the loss): position t's MoE output only reaches the logits at t, which predict label t + 1."""
    near = (gaps < BF16_TIE_MARGIN).view(ids.shape)
    labels = ids.clone()
    labels[:, 1:][near[:, :-1]] = -100
    return labels


def engine_config(s, world: int) -> dict:
    """The DeepSpeed config of a row: AutoEP on at its autoep_size, the row's ZeRO stage, clipping (0.0 written
    out: DeepSpeed 0.19 defaults gradient_clipping to 1.0), accumulation and precision; a config-built SGD when
    the row's optimizer is "config" or "config-list"."""
    config = {
        "train_batch_size": s.seqs * world * s.grad_accum, "train_micro_batch_size_per_gpu": s.seqs,
        "gradient_accumulation_steps": s.grad_accum, "gradient_clipping": s.clip,
        "zero_optimization": {"stage": s.zero_stage}, "zero_allow_untested_optimizer": True,
        "expert_parallel": {"enabled": True, "autoep_size": s.autoep_size},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if s.data_before_expert:
        config["use_data_before_expert_parallelism"] = True
    if s.optimizer.startswith("config"):
        config["optimizer"] = {"type": "SGD", "params": {"lr": LR}}
    if s.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def client_optimizer(s, model):
    """(optimizer, model_parameters) for deepspeed.initialize: "config" none (DeepSpeed builds SGD from the config)
    with `model.parameters()` as DeepSpeed's examples pass it, a generator read once AutoEP has replaced the
    experts; "config-list" the same parameters as a list made before (the old router and experts); "client" a
    torch SGD over model.parameters(), built before AutoEP replaces the experts (DeepSpeed remaps it); "callable"
    a function DeepSpeed calls after the replacement, the parameters split into MoE groups (deepspeed.moe.utils)."""
    if s.optimizer == "config":
        return None, model.parameters()
    if s.optimizer == "config-list":
        return None, list(model.parameters())
    if s.optimizer == "client":
        return torch.optim.SGD(model.parameters(), lr=LR), None

    def build_sgd(params):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(params), "name": "dense"})
        return torch.optim.SGD(groups, lr=LR)

    return build_sgd, model.parameters()


# ------------------------------------------------------------------ parameters as units (experts by global index)


def group_of(unit: str) -> str:
    """experts, router or dense (shared experts and their gate are dense: every rank holds them)."""
    if unit.startswith(MLP + "experts."):
        return "experts"
    if unit.startswith(MLP + "gate.") or unit.startswith(MLP + "router.gate."):
        return "router"
    return "dense"


def label(unit: str) -> str:
    """A unit as comparisons name it: without the one decoder layer's prefix ("mlp.experts.gate_proj[expert 5]")."""
    return unit.replace("model.layers.0.", "")


def reference_units(named: dict) -> dict:
    """The Hugging Face model's parameters (or gradients) by unit: each expert's gate / up / down projection
    alone, `model.layers.0.mlp.experts.gate_proj[expert 5]`; every other parameter under its own name."""
    out = {}
    for name, t in named.items():
        if name == MLP + "experts.gate_up_proj":
            ffn = t.shape[1] // 2  # FFN on the default rows; a --hf-config row's shrunk moe_intermediate_size
            for e in range(t.shape[0]):
                out[f"{MLP}experts.gate_proj[expert {e}]"] = t[e, :ffn]
                out[f"{MLP}experts.up_proj[expert {e}]"] = t[e, ffn:]
        elif name == MLP + "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{MLP}experts.down_proj[expert {e}]"] = t[e]
        else:
            out[name] = t
    return out


def autoep_unit(name: str, slot: int | None, experts: list) -> str:
    """An AutoEP parameter's unit: its grouped experts' local slot -> the global expert it holds; the router
    AutoEP names `router.gate` is the model's `gate`; the rest keep their names."""
    found = re.fullmatch(re.escape(MLP) + r"experts\.(w[123])", name)
    if found:
        return f"{MLP}experts.{EXPERT_PROJ[found.group(1)]}[expert {experts[slot]}]"
    return name.replace(MLP + "router.gate.", MLP + "gate.")


def experts_held(moe) -> list:
    """The global experts an AutoEP layer's local slots hold, slot by slot: the placement it declares
    (deepspeed.checkpoint.autoep_affine: 0.19.8 has it), else its uniform layout (0.19.2, 0.19.5: ep rank r holds
    experts r x L .. r x L + L - 1). Either way each slot's weights are then checked against that expert's (run.py)."""
    try:
        from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank
    except ImportError:
        return [moe.ep_rank * moe.num_local_experts + i for i in range(moe.num_local_experts)]
    return [int(e) for e in autoep_experts_for_rank(moe.expert_placement_descriptor, moe.ep_rank)]


def autoep_units(named: dict, experts: list) -> dict:
    """AutoEP's parameters (or gradients) by unit, given the global experts this rank holds, slot by slot."""
    out = {}
    for name, t in named.items():
        if re.fullmatch(re.escape(MLP) + r"experts\.w[123]", name):
            for slot in range(t.shape[0]):
                out[autoep_unit(name, slot, experts)] = t[slot]
        else:
            out[autoep_unit(name, None, experts)] = t
    return out


# ------------------------------------------------------------------ the one-process reference


@dataclasses.dataclass(kw_only=True)
class RefStep:
    """What the one-process reference computed for one optimizer step (by unit, float64)."""

    losses: list
    """Mean loss over the W slices, per micro-step."""
    slice_losses: list
    """[micro][slice] each slice's own loss (each rank's, as the engine computes it)."""
    grad: dict
    """The reduced gradient: mean over slices and micro-steps."""
    per_slice: list
    """[slice][micro] the gradient of that slice's loss alone: what a broken reduction would give."""
    norm: float
    """Global L2 norm of `grad` over every parameter (each expert once)."""
    coef: float
    """Clip coefficient min(1, clip / (norm + 1e-6)) (1.0 without clipping)."""
    update: dict
    """-lr x coef x grad."""
    routes: list
    """Routes per global expert over every slice and micro-step (an expert no token reached has nothing to show)."""
    labels: list
    """[micro][slice] the labels each slice's loss used (None: the ids themselves)."""
    after: dict
    """Every parameter after the step (float64)."""


def reference_step(ref, s, world: int, seed: int, step: int, *, compute=None, labels=None) -> RefStep:
    """One step of the reference on this process: every rank's slice of every micro-step through the Hugging
    Face model, the gradient averaged over the slices and micro-steps (what DeepSpeed's data parallelism defines:
    every rank holds as many tokens), clipped by the global norm, SGD applied to `ref` in place. `compute`: a
    low-precision copy that computes the gradients from `ref`'s weights (copied into it first) while `ref` keeps
    the float32 masters (mixed precision on one process: the bf16 noise model's baseline). A half-precision row
    leaves near-tie tokens out of the loss (tie_free_labels, read off `ref`), unless given the `labels` to use."""
    params = dict(ref.named_parameters())
    model = ref if compute is None else compute
    if compute is not None:
        with torch.no_grad():
            for n, p in compute.named_parameters():
                p.copy_(params[n])
    used = dict(model.named_parameters())
    per_slice = [[] for _ in range(world)]
    half = s.precision != "fp32"
    experts, vocab = n_experts(model.config), model.config.vocab_size
    losses, slice_losses, routes = [], [], [0] * experts
    labels = labels or [[None] * world for _ in range(s.grad_accum)]
    for m in range(s.grad_accum):
        slice_losses.append([])
        for r in range(world):
            ids = batch(seed, step, m, r, s.seqs, vocab)
            logits, router_out, aux = forward(model, ids)
            if half and labels[m][r] is None:  # read off this float32 reference (never the engine)
                labels[m][r] = tie_free_labels(ids, choice_gaps(model, router_out, s.family, s.top_k))
            loss = hf_loss(model, logits, ids if labels[m][r] is None else labels[m][r], s.loss_multiplier, aux)
            grads = torch.autograd.grad(loss, list(used.values()), allow_unused=True)
            per_slice[r].append(reference_units({n: (g if g is not None else torch.zeros_like(p)).double()
                                                 for (n, p), g in zip(used.items(), grads)}))
            slice_losses[-1].append(float(loss.detach()))
            index = router_out[2].detach()  # (tokens, top_k) expert ids: every family's router returns them third
            routes = [a + b for a, b in zip(routes, torch.bincount(index.reshape(-1), minlength=experts).tolist())]
        losses.append(sum(slice_losses[-1]) / world)
    grad = {u: sum(per_slice[r][m][u] for r in range(world) for m in range(s.grad_accum)) / (world * s.grad_accum)
            for u in per_slice[0][0]}
    norm = math.sqrt(sum(float((g * g).sum()) for g in grad.values()))
    coef = min(1.0, s.clip / (norm + 1e-6)) if s.clip > 0 else 1.0
    update = {u: -LR * coef * g for u, g in grad.items()}
    with torch.no_grad():
        for u, p in reference_units(params).items():
            p.add_(update[u].to(p.dtype))
    after = {u: p.detach().double().clone() for u, p in reference_units(params).items()}
    return RefStep(losses=losses, slice_losses=slice_losses, grad=grad, per_slice=per_slice, norm=norm, coef=coef,
                   update=update, routes=routes, labels=labels, after=after)


# ------------------------------------------------------------------ transformers 5.23+ and AutoEP


def registry_needs_shim() -> bool:
    """Whether this transformers keeps its output-capture registry in the 5.23+ form (a dict subclass whose
    get() and item assignment take a model, not the class-name string DeepSpeed 0.19's AutoEP passes)."""
    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    return isinstance(registry, dict) and type(registry) is not dict


def install_registry_shim() -> bool:
    """Let the 5.23+ registry take DeepSpeed's string keys too (`get(key, default)`, `registry[key] = value`),
    in this process only: a str key goes to dict's own method, a model to transformers' own. True when installed."""
    from transformers.utils import output_capturing

    cls = type(output_capturing._CAN_RECORD_REGISTRY)
    if cls is dict or getattr(cls, "_moebench_shim", False):
        return False
    model_get, model_set = cls.get, cls.__setitem__

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else model_get(self, key)

    def setitem(self, key, value):
        return dict.__setitem__(self, key, value) if isinstance(key, str) else model_set(self, key, value)

    cls.get, cls.__setitem__, cls._moebench_shim = get, setitem, True
    return True
