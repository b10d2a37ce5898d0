"""DeepSpeed AutoEP: a Hugging Face MoE model made expert-parallel by `deepspeed.initialize` itself
(`"expert_parallel": {"enabled": true, "autoep_size": E}`, DeepSpeed 0.19.2+), against the same model on one process.

The package's files, each one role (docs/adding-a-library.md):
- __init__.py: the adapter (identity, rows, what cannot run here, the --list note on transformers);
- rows.py: each row's settings and the matrix (a covering subset: its docstring says how it was chosen);
- resume.py: the save -> load -> continue rows (--resume); resumerun.py: such a row on every rank; resumemath.py:
  what it does with DeepSpeed (config, save / convert / load, each slot's state), pasted by --repro;
- rowmath.py: the rows' mathematics (models, data, config, reference, the transformers shim), pasted by --repro;
- run.py: a row on every rank; mechanisms.py: the mechanism of its first divergence;
- compat.py: the DeepSpeed / transformers releases AutoEP runs with; user_config.py: --ds-config for these rows;
- repro.py: the standalone reproduction script of a failing row.
It reuses the DeepSpeed package's engine plumbing (its version and import probe, group sizes, update-factor reading,
fp32 masters, --ds-config reader): AutoEP is DeepSpeed's engine, and its rows are read the way the engine rows are.
"""

from __future__ import annotations

from moebench.libraries.autoep import compat
from moebench.libraries.autoep.releases import COMPATIBILITY
from moebench.libraries.autoep.rows import KIND, NAME, PRECISIONS, matrix, row_of, user_matrix
from moebench.libraries.autoep.shape import EXPERTS, FAMILIES
from moebench.libraries.spec import RESUME, Adapter, Row, install_hint

PRELOAD = (
    "deepspeed", "torch._dynamo", "torch._inductor.compile_fx", "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.ops.op_builder.all_ops", "deepspeed.comm.mori", "deepspeed.module_inject.auto_ep",
    "deepspeed.module_inject.auto_ep_layer", "deepspeed.checkpoint.autoep_affine", "transformers",
    "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.qwen2_moe.modeling_qwen2_moe", "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "moebench.variants.deepspeed.comm", "moebench.parity.checks_engine", "moebench.parity.checks_deepspeed",
    "moebench.libraries.autoep.run", "deepspeed.checkpoint.ds_to_universal", "moebench.libraries.autoep.resumerun",
)
"""What a row's ranks would otherwise each import at every row (DeepSpeed's engine and AutoEP, the four families'
modelling code): imported once in the parent, the forked ranks inherit it (0.5 s a row at W = 2, not ~6 s)."""


class AutoEPAdapter(Adapter):
    name = NAME
    compatibility = COMPATIBILITY
    import_name = "deepspeed"
    dist_name = "deepspeed"
    extra = "autoep"
    catches = ("DeepSpeed AutoEP (a Hugging Face MoE model made expert-parallel inside deepspeed.initialize) whose "
               "losses, reduced gradients, clipping or steps differ from one process")
    preload = PRELOAD
    runners = {KIND: "moebench.libraries.autoep.run:run", RESUME: "moebench.libraries.autoep.resumerun:run"}

    def version(self) -> str | None:
        """The version of the DeepSpeed that imports (the rows record transformers' beside it)."""
        from moebench.libraries.deepspeed import ADAPTER as DEEPSPEED

        return DEEPSPEED.version()

    def unavailable(self) -> str | None:
        from moebench.libraries.deepspeed import ADAPTER as DEEPSPEED
        from moebench.preload import has_module

        problem = DEEPSPEED.unavailable()
        if problem:
            return problem
        if not has_module(compat.AUTOEP_MODULE):
            return (f"DeepSpeed {self.version()} has no AutoEP (new in {compat.FIRST_AUTOEP_RELEASE}): "
                    f"pip install 'deepspeed>={compat.FIRST_AUTOEP_RELEASE}'")
        tf = compat.transformers_version()
        if tf is None:
            return f"transformers is not installed (AutoEP converts its models): {install_hint(self.extra)}"
        if compat.release(tf) < compat.MIN_TRANSFORMERS:
            return (f"transformers {tf} has no fused experts, which AutoEP's presets need (transformers 5): "
                    f"{install_hint(self.extra)}")
        return None

    def note(self) -> str | None:
        """Which transformers the rows run with, and how to run AutoEP with one it takes as shipped."""
        tf = compat.transformers_version()
        if tf is None or self.unavailable():
            return None
        if compat.needs_shim(tf):
            return (f"with transformers {tf} AutoEP fails in deepspeed.initialize as shipped (one row shows it); "
                    "the other rows run with moebench's in-process registry shim. As shipped it runs with "
                    f"transformers <= {compat.AS_SHIPPED}: {compat.SIDE_INSTALL}")
        return f"AutoEP runs as shipped with transformers {tf}"

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        """The matrix at `world_size` (rows.py); with `user_config` (--ds-config) one row per family with the user's
        settings instead, and with --hf-config the row of the user's model (its fp32 twin too when it is bf16);
        `resume` adds the save -> load -> continue rows (resume.py)."""
        from moebench.libraries.autoep.resume import resume_rows

        tf = compat.transformers_version()
        if user_config is not None:
            variant = "hf-config" if user_config.get("model") else "ds-config"
            return [row_of(s, world_size, variant=variant if s.precision == user_config["precision"] else
                           f"{variant}+{s.precision}", note=ep_note(user_config.get("autoep_size"), s, world_size))
                    for s in user_matrix(world_size, user_config, tf)]
        extra = resume_rows(world_size, tf) if resume else []
        return [row_of(s, world_size) for s in matrix(world_size, tf)] + extra

    def skip_reason(self, row: Row) -> str | None:
        s = row.settings
        if row.kind == RESUME:
            sizes = (s.autoep_size, s.load_ep_size)
            bad = next((e for e in sizes if row.world_size % e or EXPERTS % e), None)
            return (f"autoep_size {bad} must divide the world size {row.world_size} and the {EXPERTS} experts"
                    if bad else None)
        if s.family not in FAMILIES:
            return f"unknown model family {s.family!r} (AutoEP rows build {', '.join(FAMILIES)})"
        if s.precision not in PRECISIONS:
            return (f"{s.precision} AutoEP rows are not built yet (they plug in with DeepSpeed's CPU {s.precision} "
                    "support: rows.HALF_PRECISIONS)")
        if row.world_size % s.autoep_size or s.num_experts % s.autoep_size:
            return (f"autoep_size {s.autoep_size} must divide the world size {row.world_size} and the "
                    f"{s.num_experts} experts")
        return None

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing a failing fp32 row (repro.py); None for a half-precision row."""
        from moebench.libraries.autoep import repro

        return repro.script(row, seed)


def ep_note(asked: int | None, s, world_size: int) -> str:
    """The row's note when the file's autoep_size cannot run at this world size (verified at W instead)."""
    if not asked or asked == s.autoep_size:
        return ""
    return (f"expert_parallel.autoep_size={asked} does not divide the world size {world_size} and the "
            f"{s.num_experts} experts: verified at autoep_size={s.autoep_size}, the largest that fits")


ADAPTER = AutoEPAdapter()
