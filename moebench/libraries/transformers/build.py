"""What a transformers row builds, on every rank: the family's tiny model (nothing downloaded), its seeded weights,
the batch, and the views of its (possibly DTensor) parameters.

The row space lives here too (families, expert backends, EP modes, shapes), so every file of the package reads
one definition of it.
"""

from __future__ import annotations

import contextlib
import warnings

from moebench.libraries.spec import Row
from moebench.libraries.transformers.api import BLOCK, distributed_config
from moebench.parity.layout import ExpertLayout

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
OUTPUT = "(output)"
"""The key of a wrong reference's block output (beside its parameters' gradients)."""


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
def quiet():
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


def state_dict(model_cls, config, seed: int) -> dict:
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


def copy(state: dict) -> dict:
    return {name: t.clone() for name, t in state.items()}


def batch(seed: int, step: int, world_size: int):
    """The global batch of one step (inputs, and the targets the loss projects the output on)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + 17)
    shape = (world_size * SEQS_PER_RANK, SEQ_LEN, HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def full(t):
    """A DTensor's whole value (a collective: every rank calls it in the same order); plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def is_expert(name: str) -> bool:
    return name.split(".")[0] == "experts"


def expert_offset(p) -> int:
    """The global index of this rank's first expert in an experts parameter (0 when it is not sharded)."""
    if not hasattr(p, "device_mesh"):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return int(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0])


def experts_held(p) -> list[int]:
    """The global experts an experts parameter holds on this rank, slot by slot (moebench.parity.layout: the
    contiguous layout, this rank's ep rank read off its DTensor offset)."""
    held = local(p).shape[0]
    layout = ExpertLayout(NUM_EXPERTS, NUM_EXPERTS // held)
    return layout.experts_of(expert_offset(p) // held)


def build(row: Row, seed: int):
    """(reference block, expert-parallel model, its block) for a row, on this rank."""
    config_cls, model_cls, kwargs = model_classes(row.model)
    config = config_cls(**kwargs)
    state = state_dict(model_cls, config, seed)
    # Each model gets its own copy: from_pretrained may keep the state dict's tensors as its parameters.
    reference = model_cls.from_pretrained(None, config=config, state_dict=copy(state),
                                          experts_implementation=row.backend)
    parallel = model_cls.from_pretrained(None, config=config, state_dict=copy(state),
                                         experts_implementation=row.backend,
                                         distributed_config=distributed_config(row))
    reference.train()
    parallel.train()
    return reference.get_submodule(BLOCK), parallel, parallel.get_submodule(BLOCK)
