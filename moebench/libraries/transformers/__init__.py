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
Release differences: api.py.
5.23.0 (pinned in constraints.txt) is tested at world 2 and 4; 5.22.0 and 5.17.0 were run once at world 2
(docs/libraries/transformers.md, "Releases and torch", has what they gave).

The package's files, each one role (docs/adding-a-library.md): __init__.py the adapter (rows, what cannot run
here); api.py the release differences; build.py what a row builds; parity.py the float32 rows and their
known-wrong references; bf16.py the bf16 rows; resume.py the resume rows.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from moebench.libraries.spec import BF16, NO_SETTINGS, PARITY, RESUME, Adapter, Row, install_hint
from moebench.libraries.transformers import api
from moebench.libraries.transformers.build import (
    BACKENDS,
    BF16_BACKEND,
    CUDA_BACKENDS,
    EP_MODES,
    MODELS,
    NUM_EXPERTS,
)
from moebench.libraries.transformers.releases import COMPATIBILITY

NAME = "transformers"
EXTRA = "transformers"
MIN_VERSION = (5, 0)
"""DistributedConfig (and with it expert parallelism) is a transformers 5 API; 4.x has neither."""
# Modules a runner should import in the parent before forking a row's ranks (like a parity Check's `preload`):
# each rank would otherwise import them lazily on its first row, ~1 s of a ~1.4 s row at W = 2.
PRELOAD = (
    "transformers", "transformers.distributed.mixin", "transformers.distributed.expert_parallel",
    "transformers.distributed.fsdp", "transformers.integrations.moe", "accelerate",
    "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.olmoe.modeling_olmoe",
    "transformers.models.deepseek_v3.modeling_deepseek_v3", "transformers.models.gpt_oss.modeling_gpt_oss",
    "torch.distributed.fsdp", "torch.distributed.tensor",
)
"""Only what the installed release has is imported (moebench.preload): 5.17 has no distributed.expert_parallel."""


class TransformersAdapter(Adapter):
    """Hugging Face transformers' MoE blocks under its own expert parallelism (see the module docstring)."""

    name = NAME
    compatibility = COMPATIBILITY
    import_name = "transformers"
    extra = EXTRA
    preload = PRELOAD
    runners = {PARITY: "moebench.libraries.transformers.parity:run", BF16: "moebench.libraries.transformers.bf16:run",
               RESUME: "moebench.libraries.transformers.resume:run"}

    def version(self) -> str | None:
        return api.hf_version()

    def unavailable(self) -> str | None:
        hint = install_hint(EXTRA)
        version = api.hf_version()
        if version is None or importlib.util.find_spec("transformers") is None:
            return f"transformers is not installed: {hint}"
        if api.release(version) < MIN_VERSION:
            return (f"transformers {version} has no expert parallelism (DistributedConfig arrived in "
                    f"{MIN_VERSION[0]}.{MIN_VERSION[1]}): {hint}")
        if importlib.util.find_spec("accelerate") is None:
            return f"transformers' distributed loading needs accelerate, which is not installed: {hint}"
        return None

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        """The matrix at `world_size`; with `user_config` (--hf-config: user_setup.read) the rows of the user's
        config.json instead; `resume` adds the resume rows."""
        if user_config is not None:
            from moebench.libraries.transformers.user_setup import user_rows

            return user_rows(world_size, user_config)
        rows = [Row(library=NAME, model=model, backend=backend, ep_mode=mode, world_size=world_size,
                    features=("loss-curve",))
                for model in MODELS for backend in BACKENDS for mode in EP_MODES]
        rows += [Row(library=NAME, model=MODELS[0], backend=backend, ep_mode=EP_MODES[0], world_size=world_size)
                 for backend in CUDA_BACKENDS]
        # bf16, the precision these models train in, judged by the noise model (moebench.parity.noise)
        rows += [Row(library=NAME, model=model, backend=BF16_BACKEND, ep_mode=mode, world_size=world_size, kind=BF16,
                     features=("bf16",), variant="bf16") for model in MODELS for mode in EP_MODES]
        if resume:  # save_pretrained -> from_pretrained at the same and another layout (resume.py)
            from moebench.libraries.transformers.resume import resume_rows

            rows += resume_rows(world_size)
        return rows

    def skip_reason(self, row: Row) -> str | None:
        return skip_reason(row)

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing the row (libraries/repro); None for a row that cannot run here or
        that needs a judge the script has not got (bf16: a per-element tolerance is meaningless there)."""
        if row.kind != PARITY or skip_reason(row) is not None:
            return None
        from moebench.libraries.transformers import parity

        return parity.repro_script(row, seed)


ADAPTER = TransformersAdapter()


def skip_reason(row: Row) -> str | None:
    """One line why this row cannot run here, or None (the adapter's skip_reason)."""
    import torch

    from moebench.libraries.transformers.user_setup import HFConfigSettings
    from moebench.libraries.transformers.user_setup import skip_reason as user_skip_reason

    user = isinstance(row.settings, HFConfigSettings)
    if user and user_skip_reason(row):
        return user_skip_reason(row)
    if row.model not in MODELS and not user:
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
    if not user and NUM_EXPERTS % row.world_size:
        return f"{NUM_EXPERTS} experts do not split evenly over {row.world_size} ranks"
    if api.generation() == "none":
        return (f"transformers {api.hf_version()}'s DistributedConfig has no tp_size: expert parallelism only at load "
                "time with a tp_plan, which this adapter does not drive")
    if row.ep_mode == "all_to_all" and api.generation() == "ep_plan" and "fsdp_plan" not in api.config_fields():
        return (f"transformers {api.hf_version()} has no fsdp_plan override: its FSDP-wrapped MoE block cannot be "
                "driven without its decoder layer")
    if row.ep_mode.startswith("all_to_all") and api.generation() == "enable_expert_parallel":
        return f"transformers {api.hf_version()} has no all-to-all token dispatch (ep_dispatch_experts, 5.20+)"
    if row.kind == RESUME:
        from moebench.libraries.transformers.resume import ONE_PROCESS, load_layout

        layout = load_layout(row)
        if layout != ONE_PROCESS and layout != row.ep_mode:
            return skip_reason(dataclasses.replace(row, ep_mode=layout, kind=PARITY, settings=NO_SETTINGS,
                                                   features=()))
        import transformers.distributed as hf_distributed

        if not hasattr(hf_distributed, "load_optimizer_distributed"):
            return (f"transformers {api.hf_version()} has no optimizer checkpoint for a distributed model "
                    "(save_optimizer_distributed, 5.23+)")
    return None
