"""What a transformers row builds, on every rank: the family's tiny model (nothing downloaded), its seeded weights,
the batch, and the views of its (possibly DTensor) parameters.

The row space (families, expert backends, EP modes, shapes) is defined once in sizes.py and re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

from moebench.libraries.spec import Row
from moebench.libraries.transformers.api import BLOCK, distributed_config
from moebench.libraries.transformers.sizes import (  # noqa: F401  (re-exported: the package's files read them here)
    BACKENDS,
    BF16_BACKEND,
    CUDA_BACKENDS,
    EP_MODES,
    EXPERT_INTERMEDIATE,
    HIDDEN,
    LR,
    MODELS,
    NUM_EXPERTS,
    SEQ_LEN,
    SEQS_PER_RANK,
    STEPS,
    TOP_K,
    USER_BIAS_SCALE,
)
from moebench.parity.layout import ExpertLayout

OUTPUT = "(output)"
"""The key of a wrong reference's block output (beside its parameters' gradients)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a row's model is, as every file of the package reads it: the default rows' tiny family config
    (model_classes), or a --hf-config row's shrunk config (user_setup.config_of)."""

    config_cls: Any
    model_cls: Any
    kwargs: dict
    num_experts: int
    seqs_per_rank: int
    seq_len: int
    hidden: int
    router: str
    """The block's router submodule: "gate" (every family but GPT-OSS), "router" (GPT-OSS)."""
    user: bool
    """A --hf-config row (its premise, every expert gets tokens, is asserted)."""

    def config(self):
        return self.config_cls(**self.kwargs)


def shape_of(row: Row) -> Shape:
    """The row's model, on this rank (a --hf-config row reads its file again: user_setup.config_of)."""
    from moebench.libraries.transformers.user_setup import HFConfigSettings, config_of

    if isinstance(row.settings, HFConfigSettings):
        config_cls, model_cls, kwargs = config_of(row)
        s = row.settings
        return Shape(config_cls, model_cls, kwargs, s.num_experts, s.seqs_per_rank, s.seq_len, kwargs["hidden_size"],
                     "router" if row.model == "gpt_oss" else "gate", True)
    config_cls, model_cls, kwargs = model_classes(row.model)
    return Shape(config_cls, model_cls, kwargs, NUM_EXPERTS, SEQS_PER_RANK, SEQ_LEN, HIDDEN, "gate", False)


def block_output(block, x):
    """The block's output tensor (GPT-OSS's block returns it with its router scores)."""
    y = block(x)
    return y[0] if isinstance(y, tuple) else y


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


MAX_DRAWS = 32
"""How many weight draws a --hf-config row tries before it gives up on a seed (every expert must get tokens)."""


def state_dict(model_cls, config, seed: int, shape: Shape | None = None, world_size: int = 1) -> dict:
    """Rank 0's random weights, on every rank: N(0, 1/fan_in) so routing and outputs are O(1).

    A --hf-config row (`shape.user`) draws its router's rows at one norm (so that no expert is favoured by the draw
    and each of 128-256 experts gets its share of the routes) and DeepSeek-V3's bias at USER_BIAS_SCALE, and draws
    again from the same generator until every expert gets tokens from the first step's global batch on this
    float32 model alone (never on the library's output): the row asserts it of itself too."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(seed)
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed * 7919 + 3)
    user = shape is not None and shape.user
    router = f"{BLOCK}.{shape.router}.weight" if user else None
    for _ in range(MAX_DRAWS if user else 1):
        state = {}
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                bias = name.endswith("e_score_correction_bias")
                scale = (USER_BIAS_SCALE if user else 0.1) if bias else t.shape[-1] ** -0.5
                t = torch.randn(t.shape, generator=g, dtype=t.dtype) * scale
                if name == router:
                    t = t / t.norm(dim=-1, keepdim=True)
            state[name] = t.contiguous().clone()
        if not user or min(routes(model, state, shape, seed, world_size)) > 0:
            break
    if dist.is_initialized():
        for name in sorted(state):
            dist.broadcast(state[name], 0)
    return state


def routes(model, state: dict, shape: Shape, seed: int, world_size: int) -> list[int]:
    """Routes per expert of the first step's global batch through `model` with the weights `state`."""
    import torch

    model.load_state_dict(state)
    x, _ = batch(seed, 0, world_size, shape)
    with torch.no_grad():
        index = model.get_submodule(f"{BLOCK}.{shape.router}")(x.reshape(-1, shape.hidden))[2]
    return torch.bincount(index.reshape(-1), minlength=shape.num_experts).tolist()


def copy(state: dict) -> dict:
    return {name: t.clone() for name, t in state.items()}


def batch(seed: int, step: int, world_size: int, shape: Shape | None = None):
    """The global batch of one step (inputs, and the targets the loss projects the output on); `shape`: the row's
    (None: the default rows')."""
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + 17)
    shape = ((world_size * SEQS_PER_RANK, SEQ_LEN, HIDDEN) if shape is None else
             (world_size * shape.seqs_per_rank, shape.seq_len, shape.hidden))
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


def experts_held(p, num_experts: int = NUM_EXPERTS) -> list[int]:
    """The global experts an experts parameter holds on this rank, slot by slot (moebench.parity.layout: the
    contiguous layout, this rank's ep rank read off its DTensor offset)."""
    held = local(p).shape[0]
    layout = ExpertLayout(num_experts, num_experts // held)
    return layout.experts_of(expert_offset(p) // held)


def build(row: Row, seed: int, shape: Shape | None = None):
    """(reference block, expert-parallel model, its block) for a row, on this rank."""
    shape = shape or shape_of(row)
    model_cls, config = shape.model_cls, shape.config()
    state = state_dict(model_cls, config, seed, shape, row.world_size)
    # Each model gets its own copy: from_pretrained may keep the state dict's tensors as its parameters.
    reference = model_cls.from_pretrained(None, config=config, state_dict=copy(state),
                                          experts_implementation=row.backend)
    parallel = model_cls.from_pretrained(None, config=config, state_dict=copy(state),
                                         experts_implementation=row.backend,
                                         distributed_config=distributed_config(row))
    reference.train()
    parallel.train()
    return reference.get_submodule(BLOCK), parallel, parallel.get_submodule(BLOCK)
