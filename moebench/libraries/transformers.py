"""Hugging Face transformers: its MoE blocks, expert backends and expert-parallel modes, against one process.

What a row builds (nothing is downloaded: every model comes from a tiny config object, random weights):
- a one-layer `<Model>ForCausalLM` of the row's family, seeded, its state dict broadcast from rank 0;
- the reference: the same model through `from_pretrained(None, config=..., state_dict=...,
  experts_implementation=<backend>)` on this process alone;
- the expert-parallel model through the same call plus `distributed_config=DistributedConfig(...)`,
  the public entry point transformers documents for expert parallelism (it needs `accelerate`).
Both models' MoE block (`model.layers.0.mlp`) is then driven directly: output, input gradient, the
router's (`gate.weight`) gradient, every expert's gradient named by its GLOBAL index and transformers'
own parameter name (`experts.gate_up_proj[expert 5]`), the other parameters' gradients, and STEPS
plain-SGD steps (the loss curve and the weights after them).

Expert-parallel modes (`Row.ep_mode`), as of transformers 5.23:
- `all_to_all`: `DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation="all_to_all")` - every rank
  trains on its own part of the batch (the torchtitan / DeepSeek layout), tokens travel to their
  experts by all-to-all, FSDP2 shards and averages the dense weights. The block is made an FSDP unit
  of its own (`fsdp_plan={"model.layers.*.mlp": "free_full_weight"}`) so it can be called alone.
  Reference: the whole global batch on one process; the loss is the mean over every token.
- `all_to_all+tp`: `DistributedConfig(tp_size=W, ep_size=W, ep_implementation="all_to_all")` - the W
  ranks share one batch; each sends its slice of it by all-to-all and the outputs are gathered.
- `all_reduce`: `DistributedConfig(tp_size=W, ep_size=W, ep_implementation="all_reduce")` - the W
  ranks share one batch, each runs its own experts on all of it, an all-reduce sums the outputs.
Release differences (the adapter reads the installed DistributedConfig's fields, not a version list):
- 5.23+: `ep_implementation` names the exchange (`EPImplementationInterface`); `fsdp_plan` exists.
- 5.20-5.22: `ep_size` / `ep_plan` but no `ep_implementation`: the default plan's `ep_dispatch_experts`
  rule is all-to-all; all-reduce is the plan `{gate: "ep_router", experts: "moe_tp_experts"}`. No
  `fsdp_plan`, so the data-parallel `all_to_all` rows are skipped (the block cannot be called alone).
- about 5.17-5.19: `DistributedConfig(tp_size=W, enable_expert_parallel=True)` (router masking +
  all-reduce); no all-to-all token dispatch, so the all-to-all rows are skipped with that reason.
- 5.0: no `tp_size` in DistributedConfig: every row skipped. 4.x: unavailable().
5.23.0 (pinned in constraints.txt) is tested at world 2 and 4; 5.22.0 and 5.17.0 were run once at world 2
(docs/libraries.md, "transformers releases", has what they gave).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import warnings
from typing import Any

from moebench.libraries.base import Row

NAME = "transformers"
EXTRA = "transformers"
# DistributedConfig (and with it expert parallelism) is a transformers 5 API; 4.x has neither.
MIN_VERSION = (5, 0)

MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
# The pure-torch expert backends (config `experts_implementation`); "deepgemm" and "sonicmoe" are
# CUDA kernels (listed as skipped rows where CUDA is absent).
BACKENDS = ("eager", "grouped_mm", "batched_mm")
CUDA_BACKENDS = ("deepgemm", "sonicmoe")
EP_MODES = ("all_to_all", "all_to_all+tp", "all_reduce")

# Tiny shapes: every family's block at hidden 32 with 8 experts (divisible by W = 2 and 4), top-2.
HIDDEN = 32
EXPERT_INTERMEDIATE = 16
NUM_EXPERTS = 8
TOP_K = 2
# Tokens: each rank's part of the global batch is SEQS_PER_RANK x SEQ_LEN = 32 tokens, so at W = 2
# the 8 experts share 128 routed slots: every expert gets tokens (no vacuous, all-zero gradients).
SEQS_PER_RANK = 2
SEQ_LEN = 16
# Three SGD steps: enough for a wrong gradient to bend the loss curve, cheap at this size.
STEPS = 3
LR = 0.1
BF16_BACKEND = "grouped_mm"
"""The experts implementation of the bf16 rows: transformers' default (`get_correct_experts_implementation`)."""
BLOCK = "model.layers.0.mlp"
OUTPUT = "(output)"
"""The key of a wrong reference's block output (beside its parameters' gradients)."""


# Modules a runner should import in the parent before forking a row's ranks (like a parity Check's `preload`):
# each rank would otherwise import them lazily on its first row, ~1 s of a ~1.4 s row at W = 2.
PRELOAD = (
    "transformers", "transformers.distributed.mixin", "transformers.distributed.expert_parallel",
    "transformers.distributed.fsdp", "transformers.integrations.moe", "accelerate",
    "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.olmoe.modeling_olmoe",
    "transformers.models.deepseek_v3.modeling_deepseek_v3", "torch.distributed.fsdp", "torch.distributed.tensor",
)


def _hf_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


class TransformersAdapter:
    """Hugging Face transformers' MoE blocks under its own expert parallelism (see the module docstring)."""

    name = NAME
    import_name = "transformers"
    extra = EXTRA
    preload = PRELOAD
    """Not part of the Adapter protocol: what to import before forking (see PRELOAD)."""

    def version(self) -> str | None:
        return _hf_version()

    def unavailable(self) -> str | None:
        hint = f"pip install 'moebench[{EXTRA}]'"
        version = _hf_version()
        if version is None or importlib.util.find_spec("transformers") is None:
            return f"transformers is not installed: {hint}"
        if _release(version) < MIN_VERSION:
            return (f"transformers {version} has no expert parallelism (DistributedConfig arrived in "
                    f"{MIN_VERSION[0]}.{MIN_VERSION[1]}): {hint}")
        if importlib.util.find_spec("accelerate") is None:
            return f"transformers' distributed loading needs accelerate, which is not installed: {hint}"
        return None

    def rows(self, world_size: int, *, resume: bool = False) -> list[Row]:
        rows = [Row(library=NAME, model=model, backend=backend, ep_mode=mode, world_size=world_size,
                    features=("loss-curve",))
                for model in MODELS for backend in BACKENDS for mode in EP_MODES]
        rows += [Row(library=NAME, model=MODELS[0], backend=backend, ep_mode=EP_MODES[0], world_size=world_size)
                 for backend in CUDA_BACKENDS]
        # bf16, the precision these models train in, judged by the noise model (moebench.parity.noise)
        rows += [Row(library=NAME, model=model, backend=BF16_BACKEND, ep_mode=mode, world_size=world_size,
                     features=("bf16",), variant="bf16") for model in MODELS for mode in EP_MODES]
        if resume:  # save_pretrained -> from_pretrained at the same and another layout (transformers_resume.py)
            from moebench.libraries.transformers_resume import resume_rows

            rows += resume_rows(world_size)
        return rows

    def run_row(self, ctx, row: Row, opts) -> list:
        from moebench.parity.registry import SkipCheck

        reason = skip_reason(row)
        if reason is not None:
            raise SkipCheck(reason)
        with _quiet():
            if "resume" in row.features:
                from moebench.libraries import transformers_resume

                return transformers_resume.run(ctx, row, opts)
            if "bf16" in row.features:
                return _run_bf16(ctx, row, opts)
            return _run(ctx, row, opts)

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing the row (libraries/repro.py); None for a row that cannot run here
        or that needs a judge the script has not got (bf16: a per-element tolerance is meaningless there)."""
        if skip_reason(row) is not None or "bf16" in row.features:
            return None
        from moebench.libraries.repro import fill

        config_cls, model_cls, kwargs = model_classes(row.model)
        settings = {"config_class": config_cls.__name__, "model_class": model_cls.__name__, "config": kwargs,
                    "backend": row.backend, "distributed": distributed_kwargs(row), "shares_batch": shares_batch(row),
                    "world_size": row.world_size, "seed": seed, "steps": STEPS, "lr": LR, "block": BLOCK,
                    "seqs_per_rank": SEQS_PER_RANK, "seq_len": SEQ_LEN}
        return fill("transformers_moe", settings, key=row.key())


ADAPTER = TransformersAdapter()


# ------------------------------------------------------------------ what runs where


def _config_fields() -> set[str]:
    from transformers.distributed import DistributedConfig

    return {f.name for f in dataclasses.fields(DistributedConfig)}


def _api() -> str:
    """Which DistributedConfig generation is installed: "ep_implementation", "ep_plan", "enable_expert_parallel"
    (with tp_size) or "none" (5.0: a bare enable_expert_parallel flag)."""
    fields = _config_fields()
    if "ep_implementation" in fields:
        return "ep_implementation"
    if "ep_size" in fields:
        return "ep_plan"
    if "tp_size" in fields:
        return "enable_expert_parallel"
    return "none"


def skip_reason(row: Row) -> str | None:
    """One line why this row cannot run here, or None."""
    import torch

    if row.model not in MODELS:
        return f"unknown transformers model family {row.model!r}"
    if row.backend in CUDA_BACKENDS:
        if not torch.cuda.is_available():
            return f"the {row.backend} experts are a CUDA kernel; torch sees no GPU here"
        return f"the {row.backend} experts kernel is not covered by this adapter (CPU ranks only)"
    if row.backend not in BACKENDS:
        return f"unknown experts implementation {row.backend!r}"
    if row.ep_mode not in EP_MODES:
        return f"unknown expert-parallel mode {row.ep_mode!r}"
    if row.world_size < 2:
        return "expert parallelism needs world size >= 2"
    if NUM_EXPERTS % row.world_size:
        return f"{NUM_EXPERTS} experts do not split evenly over {row.world_size} ranks"
    if _api() == "none":
        return (f"transformers {_hf_version()}'s DistributedConfig has no tp_size: expert parallelism only at load "
                "time with a tp_plan, which this adapter does not drive")
    if row.ep_mode == "all_to_all" and _api() == "ep_plan" and "fsdp_plan" not in _config_fields():
        return (f"transformers {_hf_version()} has no fsdp_plan override: its FSDP-wrapped MoE block cannot be "
                "driven without its decoder layer")
    if row.ep_mode.startswith("all_to_all") and _api() == "enable_expert_parallel":
        return f"transformers {_hf_version()} has no all-to-all token dispatch (ep_dispatch_experts, 5.20+)"
    if "resume" in row.features:
        from moebench.libraries.transformers_resume import ONE_PROCESS, load_layout

        layout = load_layout(row)
        if layout != ONE_PROCESS and layout != row.ep_mode:
            return skip_reason(dataclasses.replace(row, ep_mode=layout, features=()))
        import transformers.distributed as hf_distributed

        if not hasattr(hf_distributed, "load_optimizer_distributed"):
            return (f"transformers {_hf_version()} has no optimizer checkpoint for a distributed model "
                    "(save_optimizer_distributed, 5.23+)")
    return None


def _distributed_config(row: Row):
    """The DistributedConfig a user passes to from_pretrained for this row, in the installed release's API."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(**distributed_kwargs(row))


def distributed_kwargs(row: Row) -> dict[str, Any]:
    """The keyword arguments of the row's DistributedConfig (JSON values), in the installed release's API."""
    w, api = row.world_size, _api()
    block_rule = {f"{BLOCK.replace('.0.', '.*.')}": "free_full_weight"}
    if api == "enable_expert_parallel":  # 5.0-5.19: router masking and all-reduce only
        return dict(tp_size=w, enable_expert_parallel=True)
    kwargs: dict[str, Any]
    if row.ep_mode == "all_to_all":
        kwargs = dict(fsdp_size=w, ep_size=w, fsdp_plan=block_rule)
    else:
        kwargs = dict(tp_size=w, ep_size=w)
    implementation = "all_reduce" if row.ep_mode == "all_reduce" else "all_to_all"
    if api == "ep_implementation":
        kwargs["ep_implementation"] = implementation
    elif implementation == "all_reduce":  # 5.20-5.22: the router-masking plan
        prefix = BLOCK.replace(".0.", ".*.")
        kwargs["ep_plan"] = {f"{prefix}.gate": "ep_router", f"{prefix}.experts": "moe_tp_experts"}
    return kwargs


def shares_batch(row: Row) -> bool:
    """True when every rank holds the same (global) batch; False when each has its own part of it."""
    return row.ep_mode != "all_to_all"


def model_classes(model: str):
    """(config class, causal-LM class, config kwargs) of a family, at the tiny size."""
    import transformers as hf

    common = dict(vocab_size=16, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, num_experts_per_tok=TOP_K, pad_token_id=0, bos_token_id=0,
                  eos_token_id=None, tie_word_embeddings=False)
    if model == "mixtral":
        return hf.MixtralConfig, hf.MixtralForCausalLM, dict(
            common, intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=NUM_EXPERTS)
    if model == "qwen2_moe":
        return hf.Qwen2MoeConfig, hf.Qwen2MoeForCausalLM, dict(
            common, intermediate_size=EXPERT_INTERMEDIATE, moe_intermediate_size=EXPERT_INTERMEDIATE,
            shared_expert_intermediate_size=EXPERT_INTERMEDIATE, num_experts=NUM_EXPERTS, norm_topk_prob=False)
    if model == "qwen3_moe":
        return hf.Qwen3MoeConfig, hf.Qwen3MoeForCausalLM, dict(
            common, intermediate_size=EXPERT_INTERMEDIATE, moe_intermediate_size=EXPERT_INTERMEDIATE,
            num_experts=NUM_EXPERTS, norm_topk_prob=True, head_dim=HIDDEN // 2)
    if model == "olmoe":
        return hf.OlmoeConfig, hf.OlmoeForCausalLM, dict(
            common, intermediate_size=EXPERT_INTERMEDIATE, num_experts=NUM_EXPERTS, norm_topk_prob=False)
    if model == "deepseek_v3":
        # Four expert groups of 2, two chosen per token (the grouped top-k), one shared expert.
        return hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM, dict(
            common, intermediate_size=2 * EXPERT_INTERMEDIATE, moe_intermediate_size=EXPERT_INTERMEDIATE,
            n_routed_experts=NUM_EXPERTS, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=0,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            num_mtp_layers=0, routed_scaling_factor=1.5)
    raise ValueError(model)


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars, info logs and the DTensor / deprecation warnings stay off the console."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def _state_dict(model_cls, config, seed: int) -> dict:
    """Rank 0's random weights, on every rank: N(0, 1/fan_in) so routing and outputs are O(1)."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(seed)
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed * 7919 + 3)
    state = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            scale = 0.1 if name.endswith("e_score_correction_bias") else t.shape[-1] ** -0.5
            t = torch.randn(t.shape, generator=g, dtype=t.dtype) * scale
        state[name] = t.contiguous().clone()
    if dist.is_initialized():
        for name in sorted(state):
            dist.broadcast(state[name], 0)
    return state


def _copy(state: dict) -> dict:
    return {name: t.clone() for name, t in state.items()}


def _batch(seed: int, step: int, world_size: int):
    """The global batch of one step (inputs, and the targets the loss projects the output on)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + 17)
    shape = (world_size * SEQS_PER_RANK, SEQ_LEN, HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _full(t):
    """A DTensor's whole value (a collective: every rank calls it in the same order); plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _is_expert(name: str) -> bool:
    return name.split(".")[0] == "experts"


def _expert_map(local, whole) -> list[int | None]:
    """For each expert this rank holds, its GLOBAL index: the reference expert with identical weights."""
    import torch

    found: list[int | None] = []
    for i in range(local.shape[0]):
        found.append(next((e for e in range(whole.shape[0]) if torch.equal(local[i], whole[e])), None))
    return found


def build(row: Row, seed: int):
    """(reference block, expert-parallel model, its block) for a row, on this rank."""
    config_cls, model_cls, kwargs = model_classes(row.model)
    config = config_cls(**kwargs)
    state = _state_dict(model_cls, config, seed)
    # Each model gets its own copy: from_pretrained may keep the state dict's tensors as its parameters.
    reference = model_cls.from_pretrained(None, config=config, state_dict=_copy(state),
                                          experts_implementation=row.backend)
    parallel = model_cls.from_pretrained(None, config=config, state_dict=_copy(state),
                                         experts_implementation=row.backend,
                                         distributed_config=_distributed_config(row))
    reference.train()
    parallel.train()
    return reference.get_submodule(BLOCK), parallel, parallel.get_submodule(BLOCK)


# What two known-wrong expert-parallel implementations would give, so a failure that matches one is named
# (moebench.parity.diagnose's `alternatives`): label -> what the implementation does.
RANK_LOCAL = ("rank-local gradient", "a router gradient never all-reduced over the ranks: each rank's "
              "routing weights get gradient only through the experts it holds (AllReduceEP's backward "
              "all-reduce of top_k_weights missing)")
NO_BACKWARD_EXCHANGE = ("missing backward exchange", "an all-to-all with no backward: the gradient through "
                        "the experts never returns to the rank holding the token (input gradient through "
                        "the router only)")

UNROUTED_SLOTS = "router gradient from unrouted slots"
"""all_reduce mode: a rank's routes to other ranks' experts (sentinel slots) run through its last local expert
(batched_mm clamps the sentinel id in-bounds) weighted by a zero that hides them in the forward only
(huggingface/transformers#48687); the entry's description comes from moebench.parity.diagnose.unrouted_slots."""

SWAPPED_SCORES = ("scores paired wrong", "routing weights paired with the wrong experts: each token's top-k "
                  "weights applied to its selected experts in the wrong order")


def _wrong_references(ref, row: Row, rank: int, x_all, t_all) -> dict[str, tuple[Any, dict[str, Any]]]:
    """label -> (input gradient, {parameter: gradient}) of the one-process block made wrong on purpose,
    on copies of it (the reference itself is untouched)."""
    import copy

    import torch

    out: dict[str, tuple[Any, dict[str, Any]]] = {}

    def run(block, label):
        x = x_all.clone().requires_grad_(True)
        y = block(x)
        ((y * t_all).sum() / t_all[..., 0].numel()).backward()
        grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
        out[label] = (x.grad, {**grads, OUTPUT: y.detach()})

    swapped = copy.deepcopy(ref)
    swapped.gate.register_forward_hook(lambda module, args, output: (output[0], output[1].flip(-1), output[2]))
    run(swapped, SWAPPED_SCORES[0])
    cut = copy.deepcopy(ref)
    cut.experts.register_forward_pre_hook(lambda module, args: (args[0].detach(), *args[1:]))
    run(cut, NO_BACKWARD_EXCHANGE[0])
    if row.ep_mode == "all_reduce":
        local = copy.deepcopy(ref)
        per_rank = NUM_EXPERTS // row.world_size

        def routes_local_only(module, args, output):
            logits, weights, index = output
            off_rank = (index // per_rank) != rank
            return logits, weights.detach().where(off_rank, weights), index

        local.gate.register_forward_hook(routes_local_only)
        run(local, RANK_LOCAL[0])
        leaky = copy.deepcopy(ref)

        def sentinel_slots_in_router_grad(module, args, output):
            hidden, index, weights = args[:3]
            if weights.shape != index.shape:
                return output
            for other in range(row.world_size):  # each rank's sentinel slots, summed by the backward all-reduce
                off_rank = (index // per_rank) != other
                last = torch.full_like(index[:, :1], (other + 1) * per_rank - 1)
                clamped = module.forward(hidden.detach(), last, torch.ones_like(weights[:, :1])).detach()
                output = output + ((weights - weights.detach()) * off_rank).sum(-1, keepdim=True) * clamped
            return output

        leaky.experts.register_forward_hook(sentinel_slots_in_router_grad)
        run(leaky, UNROUTED_SLOTS)
    return out


def _run(ctx, row: Row, opts) -> list:
    import torch
    import torch.distributed as dist

    from moebench.parity import diagnose
    from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, assertion, compare, of_terms, pick
    from moebench.parity.diagnose import unrouted_slots

    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    r, w = ctx.rank, ctx.world_size
    ref, _model, par = build(row, opts.seed)
    shared = shares_batch(row)
    rows = slice(None) if shared else slice(r * SEQS_PER_RANK, (r + 1) * SEQS_PER_RANK)
    ref_params = dict(ref.named_parameters())
    out: list = []

    def cmp(name, actual, expected, **kw):
        out.append(compare(name, actual, expected, tol, rank=r, asserted=asserted, world_size=w, **kw))

    experts: dict[str, list[int | None]] = {}
    for name, p in par.named_parameters():
        if _is_expert(name):
            experts[name] = _expert_map(_local(p.detach()), ref_params[name].detach())
            missing = [i for i, e in enumerate(experts[name]) if e is None]
            out.append(assertion(f"{name}: every local expert is one of the reference's", not missing, rank=r,
                                 note=f"local experts {missing} match no reference expert" if missing else ""))

    opt = torch.optim.SGD(par.parameters(), lr=LR, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, foreach=False)
    curve, ref_curve, terms = [], [], 0.0
    for step in range(STEPS):
        x_all, t_all = _batch(opts.seed, step, w)
        x = x_all[rows].clone().requires_grad_(True)
        y = par(x)
        loss = (y * t_all[rows]).sum() / t_all[rows][..., 0].numel()  # mean over the tokens this rank holds
        loss.backward()
        xr = x_all.clone().requires_grad_(True)
        yr = ref(xr)
        ref_loss = (yr * t_all).sum() / t_all[..., 0].numel()  # mean over every token of the global batch
        ref_loss.backward()
        terms = max(terms, float((yr.detach() * t_all).abs().sum() / t_all[..., 0].numel()))  # of both signs
        total = loss.detach().clone()
        if not shared:  # the global loss: the mean over ranks of the rank losses
            dist.all_reduce(total)
            total /= w
        curve.append(float(total))
        ref_curve.append(float(ref_loss.detach()))
        if step == 0:
            wrong = _wrong_references(ref, row, r, x_all, t_all)
            # each known-wrong reference under the diagnosis name every adapter and check uses
            named = ((NO_BACKWARD_EXCHANGE, diagnose.MISSING_BACKWARD_EXCHANGE), (RANK_LOCAL, diagnose.RANK_LOCAL),
                     (SWAPPED_SCORES, diagnose.SCORES_MISPAIRED))
            described: dict[str, Any] = {label: (what, name, "") for (label, what), name in named}
            described[UNROUTED_SLOTS] = unrouted_slots(None, "the last local expert: batched_mm clamps the "
                                                       "sentinel id in-bounds")[1:]

            def alternatives(param: str | None, scale: float = 1.0) -> dict[str, Any]:
                found = {}
                for label, (input_grad, grads) in wrong.items():
                    t = input_grad[rows] * scale if param is None else grads.get(param)
                    t = t[rows] if param == OUTPUT and t is not None else t
                    if t is not None:
                        entry = described[label]  # a description, or (what, diagnosis name, cause)
                        found[label] = (t, *entry) if isinstance(entry, tuple) else (t, entry)
                return found

            cmp("output", y.detach(), yr.detach()[rows], alternatives=alternatives(OUTPUT))
            for name, p in par.named_parameters():
                ref_grad = ref_params[name].grad
                if p.grad is None:
                    out.append(assertion(f"grad {name}", False, rank=r, note="no gradient reached it (None)"))
                    continue
                if name in experts:
                    local = _local(p.grad)
                    for i, e in enumerate(experts[name]):
                        if e is not None:
                            cmp(f"grad {name}[expert {e}]", local[i], ref_grad[e])
                else:
                    cmp(f"grad {name}", _full(p.grad), ref_grad, alternatives=alternatives(name))
            # After the parameters' gradients, so that a wrong router gradient (which also bends the input
            # gradient through the router) is the first failure named, not its consequence.
            # A rank's input gradient is of its own loss: W x the global mean's when it holds 1/W of the batch.
            scale = 1 if shared else w
            cmp("input grad", x.grad, xr.grad[rows] * scale, alternatives=alternatives(None, scale))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    out.append(compare(f"loss curve ({STEPS} SGD steps)", torch.tensor(curve), torch.tensor(ref_curve),
                       of_terms(tol, terms), rank=r, asserted=asserted, world_size=w))
    for name, p in par.named_parameters():
        if name in experts:
            local = _local(p.detach())
            for i, e in enumerate(experts[name]):
                if e is not None:
                    cmp(f"{name}[expert {e}] after {STEPS} SGD steps", local[i], ref_params[name].detach()[e])
        else:
            cmp(f"{name} after {STEPS} SGD steps", _full(p.detach()), ref_params[name].detach())
    return out


# ------------------------------------------------------------------ bf16 rows: the noise model


def _param_group(name: str) -> str:
    """A block parameter's group for the bf16 diagnosis: experts, router, or the rest (shared experts, ...)."""
    return "experts" if _is_expert(name) else "router" if name.split(".")[0] == "gate" else "rest"


GROUP_WORDS = {"experts": "expert", "router": "router", "rest": "other"}
"""How a parameter group of a bf16 row is named in a sentence ("expert gradients scaled by 2")."""


def _bf16_diagnosis(groups: dict, baseline: dict, judged, world_size: int) -> dict[str, Any]:
    """What a bf16 gradient farther from float32 than the noise model allows is: a group scaled by one factor
    (named as in float32: expert gradients x W are `uniform-scale`), else the distance and each group's fit."""
    from moebench.parity import noise

    present = {g for g, s in groups.items() if s[2] > 0}
    scaled, right = noise.scaled_groups({g: groups[g] for g in present}, baseline)
    k = noise.common_factor(scaled)
    if k is not None and right == present - set(scaled):
        integer = round(k) if round(k) >= 2 and abs(k - round(k)) <= noise.FIT_RTOL * k else None
        why = f": summed instead of averaged over {world_size} ranks (the world size)" if integer == world_size else ""
        rest = f" ({', '.join(GROUP_WORDS[g] for g in sorted(right))} right within the noise)" if right else ""
        return {"name": "uniform-scale", "sentence": f"bf16: {' and '.join(GROUP_WORDS[g] for g in sorted(scaled))} "
                f"gradients scaled by {k:.3g}{rest}{why}",
                "details": {"integer": integer, "scale": k, "groups": sorted(scaled)}}
    fits = {g: noise.fit(groups[g]) for g in sorted(present)}
    shown = ", ".join(f"{GROUP_WORDS[g]} x{c:.3g} (residual {100 * resid:.0f} %)" for g, (c, resid) in fits.items())
    return {"name": "bf16-noise", "sentence": f"{judged.name.split(': ', 1)[1]} ({judged.note}); fitted per group: "
            f"{shown}", "details": {"fits": {g: list(f) for g, f in fits.items()}}}


def _run_bf16(ctx, row: Row, opts) -> list:
    """A bf16 row: the expert-parallel model loaded in bf16 (`dtype=torch.bfloat16`), one forward and backward
    of the global batch, judged by the noise model (moebench.parity.noise) against the float32 block on one
    process: the output, every parameter's gradient (each expert once over the ranks) and the input gradient,
    each at most BF16_NOISE_RATIO x the distance of the same block in bf16 on one process from float32."""
    import torch
    import torch.distributed as dist

    from moebench.parity import noise
    from moebench.parity.compare import assertion

    r, w = ctx.rank, ctx.world_size
    config_cls, model_cls, kwargs = model_classes(row.model)
    config = config_cls(**kwargs)
    state = _state_dict(model_cls, config, opts.seed)
    models = [model_cls.from_pretrained(None, config=config, state_dict=_copy(state),
                                        experts_implementation=row.backend, **extra)
              for extra in ({}, {"dtype": torch.bfloat16},
                            {"dtype": torch.bfloat16, "distributed_config": _distributed_config(row)})]
    ref, base, par = (m.train().get_submodule(BLOCK) for m in models)  # `models` keeps the whole models alive
    shared = shares_batch(row)
    rows = slice(None) if shared else slice(r * SEQS_PER_RANK, (r + 1) * SEQS_PER_RANK)
    share = 1 / w if shared else 1.0  # every rank holds the whole shared batch: counted once over the ranks
    x_all, t_all = _batch(opts.seed, 0, w)

    def forward_backward(block, x, t, dtype):
        x = x.detach().to(dtype).clone().requires_grad_(True)
        y = block(x)
        ((y.float() * t).sum() / t[..., 0].numel()).backward()  # mean over the tokens this process holds
        return y.detach().float(), x.grad.float()

    y_ref, gx_ref = forward_backward(ref, x_all, t_all, torch.float32)
    y_base, gx_base = forward_backward(base, x_all, t_all, torch.bfloat16)
    y_par, gx_par = forward_backward(par, x_all[rows], t_all[rows], torch.bfloat16)
    scale = 1 if shared else w  # a rank's input gradient is of its own loss: W x the global mean's
    out, missing = [], []
    ref_params, base_params = dict(ref.named_parameters()), dict(base.named_parameters())
    run = {g: torch.zeros(3, dtype=torch.float64) for g in ("experts", "router", "rest")}
    baseline = {g: torch.zeros(3, dtype=torch.float64) for g in run}
    for name, p in par.named_parameters():
        g, ref_grad = _param_group(name), ref_params[name].grad
        baseline[g] += noise.sums([(base_params[name].grad, ref_grad)])
        if p.grad is None:
            missing.append(name)
        elif _is_expert(name):  # each local expert against the reference expert it is (bf16 weights equal)
            local = _local(p.grad)
            for i, e in enumerate(_expert_map(_local(p.detach()), base_params[name].detach())):
                if e is None:
                    missing.append(f"{name}[local {i}]")
                else:
                    run[g] += noise.sums([(local[i], ref_grad[e])])
        else:
            run[g] += noise.sums([(_full(p.grad), ref_grad)], 1 / w)
    sums = torch.stack([noise.sums([(y_par, y_ref[rows])], share), noise.sums([(gx_par, gx_ref[rows] * scale)], share),
                        *run.values()])
    dist.all_reduce(sums)
    y_run, gx_run, *grads = sums
    run = dict(zip(run, grads))
    out.append(assertion("every parameter has a gradient and every local expert is one of the reference's",
                         not missing, rank=r, note=f"missing: {', '.join(missing)}" if missing else ""))
    out.append(noise.judge("step 1", "output", y_run, noise.sums([(y_base, y_ref)]), rank=r))
    judged = noise.judge("step 1", "parameter gradient", sum(run.values()), sum(baseline.values()), rank=r)
    if not judged.passed:
        judged.diagnosis = _bf16_diagnosis(run, baseline, judged, w)
    out.append(judged)
    out.append(noise.judge("step 1", "input grad", gx_run, noise.sums([(gx_base, gx_ref)]), rank=r))
    return out
