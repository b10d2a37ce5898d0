"""The parity check registry, as data.

How to add a check (e.g. in moebench/parity/checks_foo.py):

    from moebench.parity.registry import Check, CheckOptions, SkipCheck, register
    from moebench.parity.compare import STRICT, SEED_ALLCLOSE_DEFAULT, compare, pick

    def _rank(ctx, opts: CheckOptions) -> list[Comparison]:
        # runs on EVERY rank with the process group initialised (ctx: launch.RankContext);
        # build the distributed thing and a single-process reference, then compare.
        tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
        return [compare("output", out, ref_out, tol, rank=ctx.rank, asserted=asserted)]
        # raise SkipCheck("why") to skip (e.g. an optional package is missing)

    register(Check(name="foo", order=50, seed_source="000 ...", description="...",
                   catches="a foo that ... (one line: the defect a failure points at)", rank_fn=_rank,
                   requires=("deepspeed",)))

then add the module name to CHECK_MODULES below. A check passes when every rank returned, at
least one asserted comparison exists, and every asserted comparison passed. The registry imports
check modules defensively: a module that is missing or fails to import never breaks `--list`
(its import error is kept in IMPORT_ERRORS and reported).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import traceback
from typing import Any, Callable

from moebench.config import MAX_WORLD_SIZE  # noqa: E402,F401 - env-check reads the cap from here too
from moebench.errors import UserError

CHECK_MODULES = (
    "moebench.parity.checks_ddp",
    "moebench.parity.checks_replicate",
    "moebench.parity.checks_allgather",
    "moebench.parity.checks_experts",
    "moebench.parity.checks_moe",
    "moebench.parity.checks_deepspeed",
    "moebench.parity.checks_routing",
    "moebench.parity.checks_losscurve",
    "moebench.parity.checks_engine",
)

# --impl keys a user may replace, and the contract each must meet (also in docs/verify-parity.md).
IMPL_CONTRACTS = {
    "all-gather": "fn(t, dim=0, sizes=None) -> (gathered, sizes); autograd-capable",
    "experts": "Class(list_of_expert_modules); forward(x[batch, experts, tokens, dim], is_distributed=None)",
    "ddp": "Wrapper(module) -> module: rank 0's parameters broadcast when built, "
    "gradients averaged over ranks (like DDP)",
    "replicate": "fn(module, **kwargs) -> module, like torch.distributed._composable.replicate",
    "moe": "Class(num_expert=, d_model=, d_hidden=, top_k=, world_size=) like FMoEReference (same state_dict keys)",
    "moe-sync": "fn(model) after backward: makes every rank's gradients the global-batch ones",
    "switch-gate": "Class(d_model, num_expert, world_size) like fastmoe's SwitchGate: forward(x[N, d]) -> "
                   "(idx[N, 1] with -1 = dropped, score[N, 1]); capacity ceil(rate x N / num_expert)",
}


class SkipCheck(Exception):
    """Raised by a rank function to skip its check with a reason."""


class Refused(Exception):
    """Raised by a rank function (on every rank) when the library under test refused the operation the
    check asks of it (e.g. a checkpoint load): the check's status is "refused", with this message. A
    refusal is a documented limitation, not a failure: it does not by itself fail the run."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckOptions:
    """What every rank of every check is told (must stay picklable)."""

    tolerance: str = "strict"
    """"strict" or "seed" (see compare.py)."""
    impls: dict[str, str] = dataclasses.field(default_factory=dict)
    """--impl overrides: key ("all-gather", "experts", ...) -> "package.module:attribute"."""
    seed: int = 0
    """Base random seed; every rank derives its tensors from it deterministically."""
    timeout_s: float = 120.0
    """This check's deadline (seconds): a check that opens process groups of its own derives
    their timeout from it (launch.PG_TIMEOUT_FRACTION), so a collective fails before the deadline."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Check:
    """One registered parity check."""

    name: str
    """The name used by --checks, e.g. "ddp-adam"."""
    order: int
    """Position in --list and in the table (the issue's numbering x 10)."""
    seed_source: str
    """The seed document it comes from, e.g. "003 test_c10d_spawn_gloo"."""
    description: str
    """One line: what it asserts."""
    catches: str
    """One line: the defect this check would catch (shown in reports)."""
    rank_fn: Callable[..., list]
    """fn(ctx: RankContext, opts: CheckOptions) -> list[Comparison], run on every rank."""
    min_world_size: int = 1
    """Smaller worlds skip the check with a reason."""
    max_world_size: int | None = None
    """Larger worlds skip the check with a reason (None: no limit)."""
    requires: tuple[str, ...] = ()
    """Importable modules the check needs; a missing one skips it with a reason."""
    impl_keys: tuple[str, ...] = ()
    """Which --impl keys this check exercises."""
    timeout_s: float | None = None
    """Deadline override for this check (None: --timeout)."""
    cuda_ready: bool = False
    """True when the rank function puts its tensors on ctx.device (so it can run on NCCL). A
    check that is not runs on gloo / CPU even where "auto" would pick NCCL, and is skipped when
    --backend nccl forces NCCL locally (under torchrun the job's group is "cpu:gloo,cuda:nccl")."""
    preload: tuple[str, ...] = ()
    """Modules imported in the parent before the ranks fork, so N ranks do not each pay the import
    (DDP imports torch._dynamo lazily: ~1 s alone, ~2 s per rank when 4 ranks do it at once)."""
    world_size: int | None = None
    """Run on exactly this many ranks whatever --world-size says (a library row's world); None: the run's."""
    labels: tuple[tuple[str, object], ...] = ()
    """(field, value) pairs carried into the check's record as `labels` (a library row's library,
    version, model, backend, ep_mode, world_size, features)."""
    skip_if: Callable[[], str | None] | None = None
    """Asked in the parent before any rank starts: one line why the check cannot run here, or None (a
    library row's adapter.skip_reason)."""

    def skip_reason(self, world_size: int) -> str | None:
        if self.world_size is not None and world_size != self.world_size:
            return f"needs exactly {self.world_size} ranks"
        if world_size < self.min_world_size:
            return f"needs world size >= {self.min_world_size}"
        if self.max_world_size is not None and world_size > self.max_world_size:
            return f"needs world size <= {self.max_world_size}"
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        return self.skip_if() if self.skip_if is not None else None


REGISTRY: dict[str, Check] = {}
IMPORT_ERRORS: dict[str, str] = {}
_loaded = False


def register(check: Check) -> Check:
    REGISTRY[check.name] = check
    return check


def load_all() -> dict[str, Check]:
    """Import every check module once (defensively) and return the registry."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in CHECK_MODULES:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:  # the module exists but something it imports does not
                    IMPORT_ERRORS[module] = traceback.format_exc()
            except Exception:  # noqa: BLE001 - one broken check module must not break the others
                IMPORT_ERRORS[module] = traceback.format_exc()
    return REGISTRY


def all_checks() -> list[Check]:
    return sorted(load_all().values(), key=lambda c: (c.order, c.name))


def select(names: list[str] | None) -> list[Check]:
    """The checks named by --checks (all when None), in registry order; unknown names are a UserError."""
    checks = all_checks()
    if not names:
        return checks
    known = {c.name for c in checks}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"unknown check(s) {', '.join(unknown)}; see `moebench verify-parity --list`",
                        flag="--checks")
    return [c for c in checks if c.name in names]


IMPL_IMPORT_TIMEOUT_S = 60.0
"""How long a --impl module may take to import in the probe (torch alone takes ~2 s here)."""


IMPL_CLASS_KEYS = ("experts", "moe", "switch-gate")
"""Keys whose contract is a class (instantiated per check); the others take any callable."""
IMPL_CALL_ARGS: dict[str, tuple[tuple, dict]] = {
    "all-gather": (("t",), {}),
    "experts": (([],), {}),
    "ddp": (("module",), {}),
    "replicate": (("module",), {}),
    "moe": ((), {"num_expert": 1, "d_model": 1, "d_hidden": 1, "top_k": 1, "world_size": 1}),
    "moe-sync": (("model",), {}),
    "switch-gate": ((1, 1, 1), {}),
}
"""How each check calls (or builds) the object: its signature must accept these (IMPL_CONTRACTS)."""


def interface_problem(key: str, obj: Any) -> str:
    """What keeps `obj` from meeting `key`'s contract ("" when nothing does): callable, class, signature."""
    contract = IMPL_CONTRACTS[key].split(";")[0]
    if not callable(obj):
        return f"is a {type(obj).__name__}, not callable; {key} needs {contract}"
    if key in IMPL_CLASS_KEYS and not inspect.isclass(obj):
        return f"is a {type(obj).__name__}, not a class; {key} needs {contract}"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return ""
    args, kwargs = IMPL_CALL_ARGS[key]
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"cannot be called as {key} needs ({exc}); {key} needs {contract}"
    return ""


def parse_impls(specs: list[str], timeout_s: float = IMPL_IMPORT_TIMEOUT_S) -> dict[str, str]:
    """--impl key=package.module:attr, validated before anything runs: each key once, and the target
    imported in a child process bounded by `timeout_s` and checked against its key's contract."""
    impls: dict[str, str] = {}
    for spec in specs:
        key, sep, target = spec.partition("=")
        if not sep or key not in IMPL_CONTRACTS or ":" not in target:
            raise UserError(f"expected KEY=package.module:attribute with KEY in {', '.join(IMPL_CONTRACTS)}, "
                            f"got {spec[:80]!r}", flag="--impl")
        if key in impls:  # one implementation per key: the last one would silently win
            raise UserError(f"{key} is given twice ({impls[key]!r} and {target!r}); give each key once",
                            flag="--impl")
        impls[key] = target
    for key, target in impls.items():
        problem = import_problem(target, timeout_s, key=key)
        if problem:
            raise UserError(f"{target!r} {problem}", flag="--impl")
    return impls


def import_problem(target: str, timeout_s: float, key: str | None = None,
                   validate: Callable[[Any], str] | None = None) -> str:
    """Import `target` in a forked child, never here: what went wrong ("" when it imports). A module
    that raises, calls sys.exit / os._exit or hangs at import cannot take the command with it. `key` checks
    the object against that --impl key's contract, `validate` (run in the child) with a check of the caller's.
    What the module prints goes to stderr: stdout is --json's."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_import_child, args=(target, writer, key, validate), daemon=True)
    child.start()
    writer.close()
    child.join(timeout_s)
    if child.is_alive():
        from moebench.orphans import kill_tree

        kill_tree(child.pid)  # and whatever the import started
        child.join(5)
        return f"did not finish importing within {timeout_s:g} s (a hang at import? --timeout sets the limit)"
    try:
        message = reader.recv() if reader.poll() else None
    except EOFError:  # the child closed the pipe without a word: it died
        message = None
    if message is None:
        return f"ended the importing process with exit code {child.exitcode} (os._exit or a crash at import)"
    return message


def _import_child(target: str, writer, key: str | None = None, validate: Callable[[Any], str] | None = None) -> None:
    import os
    import sys

    os.dup2(2, 1)  # a module that prints at import must not break --json on stdout
    try:
        obj = load_impl(target)
        writer.send(interface_problem(key, obj) if key else validate(obj) if validate else "")
        sys.stdout.flush()
    except SystemExit as exc:
        writer.send(f"called sys.exit({exc.code!r}) while importing")
    except BaseException as exc:  # noqa: BLE001 - whatever the import does is the user's input
        writer.send(f"does not import: {type(exc).__name__}: {exc}")


def load_impl(target: str) -> Any:
    """"package.module:attr" -> the object."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def impl_or_default(opts: CheckOptions, key: str, default: Any) -> tuple[Any, str]:
    """The user's implementation for `key` if --impl gave one, else `default`; plus its label."""
    if key in opts.impls:
        return load_impl(opts.impls[key]), opts.impls[key]
    return default, f"{getattr(default, '__module__', '')}:{getattr(default, '__qualname__', repr(default))}"
