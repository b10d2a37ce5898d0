"""The Python API: `moebench.run`, `moebench.verify_parity`, `moebench.env_check`, `moebench.checkpoint`.

Each returns the dict its command prints with `--json` and records the same run folder under
results/ (see docs/api.md). They call the core functions the CLI calls, through the same
validation: bad input raises `moebench.errors.UserError` (naming the flag) before anything is
written. Nothing prints unless asked (`progress=True`).

    import moebench
    summary = moebench.run("fastmoe", preset="quick", experts=4, steps=20)
    parity = moebench.verify_parity(world_size=2, checks=["all-gather-variable", "experts"])
    env = moebench.env_check(probe=False)
    audit = moebench.checkpoint("ckpt/step-1000", experts=64)

`import moebench` stays cheap: this module (and torch) is imported on first use of a function.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from moebench.errors import UserError

__all__ = ["run", "verify_parity", "env_check", "checkpoint"]


def run(variant: str, preset: str | None = None, *, results_dir: str | None = None, force: bool = False,
        progress: bool = False, **settings: Any) -> dict[str, Any] | None:
    """Train `variant` ("fastmoe" or "deepspeed") like `moebench run <variant> --json`.

    `preset`: a preset of experiments/<variant>/ (default: the variant's own, as on the CLI).
    `settings`: the run's flags by field name, overriding the preset: `experts=4`, `steps=20`,
    `world_size=2`, `timeout_s=60`, ... (`moebench run <variant> --help` lists them: --top-k is
    `top_k`, --timeout is `timeout_s`). `force`: run even when the memory estimate exceeds the
    available memory. `progress`: show the progress bar on stderr.

    Returns summary.json's content (the `--json` document; None on a torchrun rank other than 0).
    A run that started and failed raises `moebench.errors.RunFailed` (its folder says why);
    Ctrl-C raises KeyboardInterrupt after every rank has stopped and the run is marked interrupted.
    """
    from moebench import config as config_tree
    from moebench import results, train, variants

    names = [v.name for v in variants.VARIANTS]
    if not isinstance(variant, str) or variant not in names:
        raise UserError(f"unknown variant {variant!r}; use one of: {', '.join(names)}")
    chosen = variants.by_name(variant)
    overrides = config_tree.overrides_by_name(chosen.config_cls, settings, where=f"run {variant}")
    config = variants.checked_config(chosen, preset, overrides, results_dir=results_dir, force=force)
    outcome = train.run_variant(chosen, config, results_root=results_dir, show_progress=progress)
    return None if outcome.run_path is None else results.to_jsonable(outcome.summary)


def verify_parity(*, world_size: int | None = None, checks: str | Sequence[str] | None = None,
                  timeout_s: float = 120.0, comm_backend: str = "auto", tolerance: str = "strict",
                  impls: Mapping[str, str] | Sequence[str] = (), seed: int = 0, debug_collectives: bool = False,
                  results_dir: str | None = None, library: str | Sequence[str] | None = None,
                  adapter: Any = None, ds_config: str | None = None, hf_config: str | None = None,
                  recipe: str | None = None, torchtitan_args: str | None = None, allow_imports: Sequence[str] = (),
                  resume: bool = False, repro: str | None = None, rows: Sequence[str] = (),
                  full: bool = False) -> dict[str, Any]:
    """The parity checks, or a library's conformance rows, like `moebench verify-parity --json`.

    The checks: `checks` names (see `moebench verify-parity --list`) or None for all, at `world_size` ranks
    (default 4); `impls`: your code instead of moebench's, {"experts": "my_pkg.moe:Experts", ...} (the `--impl`
    contracts of docs/verify-parity.md). The library rows instead (docs/libraries/README.md): `library` names
    ("deepspeed" or ["fairscale", "transformers"]), `adapter` your own adapter (the object, or "pkg.mod:ADAPTER",
    docs/adding-a-library.md), at `world_size` or at 2 and 4. Your own setup (docs/libraries/README.md, "Verify
    your own launch"): `ds_config` a DeepSpeed config file, `hf_config` a model's config.json, `recipe` an Automodel
    recipe YAML, `torchtitan_args` the arguments given to torchtitan.train (one string), `allow_imports` the modules
    outside its framework a recipe or torchtitan module may import. `resume` the resume rows, `rows` only the rows
    whose key matches one of these globs, `repro` a new folder for the failing rows' standalone scripts.
    Returns the summary: "status" ("ok" when at least one check passed and none failed, else "failed"), one
    record per check under "checks" (each with its failed comparisons; every comparison with `full=True`, and
    always in the run's summary.json) and, for library rows, one record per row under "rows".
    """
    from moebench import config as config_tree
    from moebench import results
    from moebench.parity.printed import failed_only
    from moebench.parity.runner import parity_config
    from moebench.parity.runner import verify_parity as run_parity

    config_tree.require_launch_env()
    _require_types(world_size=world_size, checks=checks, timeout_s=timeout_s, comm_backend=comm_backend,
                   tolerance=tolerance, impls=impls, seed=seed, debug_collectives=debug_collectives,
                   results_dir=results_dir, library=library, adapter=adapter, ds_config=ds_config,
                   hf_config=hf_config, recipe=recipe, torchtitan_args=torchtitan_args, allow_imports=allow_imports,
                   resume=resume, repro=repro, rows=rows, full=full)
    results.check_root(results_dir, "parity")
    setup = dict(ds_config=ds_config, hf_config=hf_config, recipe=recipe, torchtitan_args=torchtitan_args)
    if isinstance(allow_imports, str):
        allow_imports = (allow_imports,)
    if allow_imports and all(v is None for v in setup.values()):
        raise UserError("lets a recipe or torchtitan_args import code outside its framework; give one of them too",
                        flag="--allow-import")
    rows_asked = library is not None or adapter is not None or any(v is not None for v in setup.values())
    if rows_asked and checks is not None:
        raise UserError("runs the library rows, not checks; drop checks or library", flag="--library")
    for flag, given in (("--repro", repro is not None), ("--resume", resume), ("--row", bool(rows))):
        if given and not rows_asked:
            raise UserError("applies to library rows; give library= (or adapter=) too", flag=flag)
    if isinstance(rows, str):
        rows = (rows,)
    config = parity_config(world_size=4 if world_size is None else world_size, checks=checks, timeout_s=timeout_s,
                           comm_backend=comm_backend, tolerance=tolerance, impls=impls,
                           debug_collectives=debug_collectives, seed=seed)
    if not rows_asked:
        from moebench.resources import require_ranks_fit

        require_ranks_fit(config.world_size)
        summary = run_parity(config, results_dir=results_dir)
    else:
        from moebench.libraries import verify

        request = verify.LibraryRequest(libraries=verify.names_of(library) if library is not None else (),
                                        adapter=adapter, world_size=world_size, resume=resume, repro=repro,
                                        rows=tuple(rows), timeout_s=config.timeout_s,
                                        allow_imports=tuple(allow_imports), **setup)
        summary = verify.run(verify.prepare(request, results_dir), config, results_dir=results_dir)
    return results.to_jsonable(summary if full else failed_only(summary))


_PATH = (str, os.PathLike)
_NAMES = "a string or a list of strings"
VERIFY_PARITY_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    # argument: (the types it takes, how the error says it, whether None is allowed)
    "world_size": ((int,), "an int", True),
    "checks": ((str, list, tuple), _NAMES, True),
    "timeout_s": ((int, float), "a number of seconds", False),
    "comm_backend": ((str,), "a string", False),
    "tolerance": ((str,), "a string", False),
    "impls": ((dict, list, tuple), "a dict {KEY: 'module:attr'} or a list of 'KEY=module:attr' strings", False),
    "seed": ((int,), "an int", False),
    "debug_collectives": ((bool,), "True or False", False),
    "results_dir": (_PATH, "a path", True),
    "library": ((str, list, tuple), _NAMES, True),
    "adapter": ((str,), "an Adapter object or 'package.module:ATTRIBUTE'", True),
    "ds_config": (_PATH, "a path", True),
    "hf_config": (_PATH, "a path", True),
    "recipe": (_PATH, "a path", True),
    "torchtitan_args": ((str,), "a string (the arguments, as typed after -m torchtitan.train)", True),
    "allow_imports": ((str, list, tuple), _NAMES, False),
    "resume": ((bool,), "True or False", False),
    "repro": (_PATH, "a path", True),
    "rows": ((str, list, tuple), _NAMES, False),
    "full": ((bool,), "True or False", False),
}
"""verify_parity's arguments and the types each takes: anything else is a UserError naming its flag."""
_FLAGS = {"timeout_s": "--timeout", "impls": "--impl", "rows": "--row", "full": "--json-full",
          "allow_imports": "--allow-import"}


def _require_types(**given: Any) -> None:
    from moebench.libraries.spec import Adapter

    for name, value in given.items():
        types, words, none_ok = VERIFY_PARITY_TYPES[name]
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        if value is None and none_ok:
            continue
        if name == "adapter" and isinstance(value, Adapter):
            continue
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if ok and isinstance(value, (list, tuple)) and name != "impls":
            ok = all(isinstance(v, str) for v in value)
        if ok and name == "impls":
            items = value.items() if isinstance(value, dict) else [(v, "") for v in value]
            ok = all(isinstance(k, str) and isinstance(v, str) for k, v in items)
        if not ok:
            inner = list(value.values()) if isinstance(value, dict) else value
            shown = type(value).__name__ if not isinstance(value, (list, tuple, dict)) else \
                f"a {type(value).__name__} holding {', '.join(sorted({type(v).__name__ for v in inner}))}"
            raise UserError(f"{name}= takes {words}, got {shown}", flag=flag)


def env_check(*, probe: bool = True, probe_timeout_s: float = 30.0, strict: bool = False,
              results_dir: str | None = None) -> dict[str, Any]:
    """Probe the environment, like `moebench env-check --json`.

    `probe`: run the live 2-rank collective probe (`--no-probe` is `probe=False`). Returns the
    envcheck.json document: per check an id, status (ok / warn / fail / skip), what was found and
    the fix. `strict` only changes the exit code recorded in the run's summary.json (warnings count).
    """
    from moebench import results
    from moebench.envcheck.runner import check_and_record

    _, document, _ = check_and_record(probe=probe, probe_timeout_s=probe_timeout_s, strict=strict,
                                      results_dir=results_dir)
    return results.to_jsonable(document)



def checkpoint(path: str | os.PathLike, *, hf_config: str | os.PathLike | None = None, experts: int | None = None,
               against: str | os.PathLike | None = None, results_dir: str | None = None) -> dict[str, Any]:
    """Audit a checkpoint folder on disk, like `moebench checkpoint PATH --json` (docs/checkpoint.md).

    `hf_config` a model's config.json or `experts` the experts per MoE layer (the count the checkpoint must hold);
    `against` the same model in another layout or format, compared expert by expert. Returns the document:
    "status" ("sound" or "problems"), "problems" (each with its name, sentence, tensor, layer and experts),
    "layers", "optimizer", "saved" (what it was saved at) and "loads". Bad input raises UserError before anything
    is read or written.
    """
    from moebench.checkpoint_audit.run import checked_audit

    return checked_audit(path, hf_config=hf_config, experts=experts, against=against, results_dir=results_dir)
