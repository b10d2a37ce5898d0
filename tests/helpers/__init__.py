"""Helpers the tests share (tests/ is on sys.path under pytest)."""

from __future__ import annotations

from moebench import config as config_tree


def make_config(variant_name: str, preset: str = "quick", **flat):
    """A validated run config of a variant from a preset with flat field overrides (world_size=2,
    moe_impl="reference", ...), built without resolving "auto" (no torch probing, no prepare)."""
    from moebench import variants

    variant = variants.by_name(variant_name)
    paths = {spec.path[-1]: spec.path for spec in config_tree.leaves(variant.config_cls)}
    unknown = sorted(set(flat) - set(paths))
    assert not unknown, f"no such field: {unknown}"
    return config_tree.resolve(variant.config_cls, variant.name, preset, {paths[k]: v for k, v in flat.items()})


def fastmoe_config(**flat):
    """A fastmoe config on the reference implementation (the quick preset under `flat`)."""
    return make_config("fastmoe", **{"moe_impl": "reference", **flat})


def library_checks(names, world_sizes, **kwargs):
    """The row checks of the named libraries (moebench.libraries.matrix.row_checks on the registry's adapters)."""
    from moebench.libraries import matrix, registry

    return matrix.row_checks(registry.require(list(names)), tuple(world_sizes), **kwargs)
