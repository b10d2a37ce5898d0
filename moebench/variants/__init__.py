"""The registry of trainable variants, as data, behind one `Variant` protocol.

`moebench run <name>`, env-check's "what can run here", `make all` (via `moebench run --list`)
and every later reader (report, bench) iterate over `VARIANTS`; nothing outside a variant's own
package branches on its name. Adding a variant is one sub-package and one entry here.

A variant package holds `config.py` (its run config: the shared tree with its own MoE layer
config; torch-free, so --help stays fast), `model.py` (model build) and `rank.py` (the rank
function). Its presets live in the top-level experiments/<name>/.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from moebench import config as config_tree
from moebench.rankenv import is_launched_rank, launched_world_size


class Variant(Protocol):
    name: str
    """Sub-command name and results kind: `moebench run <name>` writes results/<name>/."""
    description: str
    """One line for --help."""
    requires: tuple[str, ...]
    """Python modules the variant needs on every path (for env-check)."""
    default_preset: str
    """Preset under experiments/<name>/ used when no --preset is given."""
    config_cls: type
    """Its run config class (moebench.config's tree with its own `moe` sub-config)."""
    published: tuple
    """The chapter's figures for it (moebench.published), compared in every summary."""

    def file_values(self, explicit: dict[tuple[str, ...], Any], config: Any) -> dict[tuple[str, ...], Any]:
        """Field values that files named in the config set (DeepSpeed's --ds-config), by field path;
        the flags in `explicit` win, and a conflicting one is a UserError."""

    def file_notes(self, values: dict[tuple[str, ...], Any], preset_config: Any) -> list[str]:
        """One line per value of `file_values` that replaces the preset's (the user is told)."""

    def prepare(self, config: Any) -> Any:
        """The config with every "auto" resolved for this machine (device, backends); UserError if
        the request cannot run here. Imports torch."""

    def rank_fn(self) -> Callable[..., dict]:
        """The rank function `fn(ctx, run_path, config_dict, show_progress) -> summary`."""

    def step_parts(self, config: Any) -> Any:
        """A context manager yielding the run's training step on one in-process rank, phase by
        phase (moebench.loop.StepParts), for `moebench bench --train`."""

    def headline(self, config: Any) -> str:
        """The one line printed before training starts."""

    def report_lines(self, summary: dict) -> list[str]:
        """Variant-specific lines printed after the shared report (plain text)."""

    def capability(self, lookup: Callable[[str], Any]) -> tuple[str, str, str]:
        """env-check's "what can run here": (status, found, hint) from the other checks' results."""


def resolve_config(variant: Variant, preset: str | None, overrides: dict[tuple[str, ...], Any],
                   notes: list[str] | None = None) -> Any:
    """Preset (default: the variant's) <- files it names <- flags, validated, "auto" resolved for
    this machine. Under torchrun the launcher's WORLD_SIZE decides the world size. `notes`, when
    given, receives one line per preset value a file replaced (the CLI prints them)."""
    explicit = {path: value for path, value in overrides.items() if value is not None}
    if is_launched_rank():
        config_tree.require_launched_world(explicit.get(("launch", "world_size")))
        explicit[("launch", "world_size")] = launched_world_size()
    preset = variant.default_preset if preset is None else preset  # "" is bad input, not the default
    config = config_tree.resolve(variant.config_cls, variant.name, preset, explicit)
    from_files = variant.file_values(explicit, config)
    if from_files:
        if notes is not None:
            notes.extend(variant.file_notes(from_files, config))
        config = config_tree.resolve(variant.config_cls, variant.name, preset, {**from_files, **explicit})
    return variant.prepare(config)


def checked_config(variant: Variant, preset: str | None, overrides: dict[tuple[str, ...], Any], *,
                   results_dir: str | None = None, force: bool = False, notes: list[str] | None = None) -> Any:
    """Everything `run` checks before it writes anything, for the CLI (`--show-config` included: it
    refuses exactly as the run would) and the Python API alike: the results root is writable, the
    config resolves and validates, and its memory and work estimates fit unless `force`. Bad input is
    a UserError naming the flag the user gave."""
    from moebench import config as config_tree
    from moebench import resources, results

    results.check_root(results_dir, variant.name)
    config = resolve_config(variant, preset, overrides, notes=notes)  # notes: what a --ds-config replaced
    names = {spec.path: spec.name for spec in config_tree.leaves(variant.config_cls)}
    given = {names[path] for path, value in overrides.items() if value is not None and path in names}
    resources.require_runnable(config, force=force, given=given)
    return config


def _registry() -> tuple[Variant, ...]:
    from moebench.variants.deepspeed import VARIANT as DEEPSPEED
    from moebench.variants.fastmoe import VARIANT as FASTMOE

    return (FASTMOE, DEEPSPEED)


VARIANTS: tuple[Variant, ...] = _registry()


def by_name(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise KeyError(name)
