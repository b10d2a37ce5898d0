"""A stand-in `triton`, for importing a library whose modules import triton at module level for kernels no CPU row
launches (megatron-core 0.17+: transformer/moe/ops/paged_stash.py; torchtitan 0.3: distributed/minimal_async_ep/
kernels.py, 0.2: models/moe/kernels.py). triton is ~1 GB; moebench does not install it.

`stand_in_triton(owner, prefix)`: while the block runs, where triton is missing, `triton` and `triton.language` are
stand-ins: `triton.jit` (bare or with arguments), `autotune` and `heuristics` give a kernel that raises, naming itself
and `owner`, if it is ever launched (a row that reached one fails saying so, never computes something else);
`triton.__version__` reads "0.0.0" (a library's own version checks take their no-triton path); every
`triton.language` name is a placeholder for the annotations a kernel's definition evaluates. Whatever torch itself asks
of triton is settled before the stand-in exists (TORCH_FIRST), and sys.modules is as before afterwards; a module
outside the library (`prefix`) that kept the stand-in is an error, not a later surprise. megatron/standins.py and
torchtitan/imports.py import through it.

This module imports only the standard library: `--repro` scripts paste it (@TRITON@) ahead of the files using it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types

TORCH_FIRST = ("torch._dynamo", "functorch.compile", "torch._inductor.ir", "torch._inductor.lowering",
               "torch._inductor.compile_fx", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
               "torch.distributed.tensor.experimental", "torch.distributed._functional_collectives",
               "torch.distributed.fsdp")
"""torch's modules that probe triton when they import: imported before the stand-in exists (they find none)."""


class StubKernel:
    """What `triton.jit` gives under the stand-in: a kernel that raises when launched."""

    owner = "a library"
    """The library imported with the stand-in (set per stand-in: `triton_modules`)."""

    def __init__(self, fn=None):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def _raise(self, *args, **kwargs):
        raise RuntimeError(f"Triton kernel {self.__name__} launched, but triton is not installed here (moebench "
                           f"imported {self.owner} with a stand-in triton: this path needs a GPU and triton)")

    __call__ = _raise

    def __getitem__(self, grid):
        return self._raise


class _Type:
    """A triton.language name used in annotations or at module level (constexpr, dtypes, pointer_type(...))."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"tl.{self.name}"

    def __call__(self, *args, **kwargs):
        return _Type(f"{self.name}(...)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Type(f"{self.name}.{name}")


def triton_modules(owner: str) -> dict[str, types.ModuleType]:
    """The stand-in `triton` and `triton.language`, their kernels naming `owner` when launched."""
    kernel = type("StubKernel", (StubKernel,), {"owner": owner})

    def decorator(*args, **kwargs):
        """triton.jit / autotune / heuristics, bare or with arguments."""
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return kernel(args[0])
        return kernel

    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.__version__ = "0.0.0"
    triton.jit = triton.autotune = triton.heuristics = decorator
    triton.Config = _Type("Config")
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << max(0, (int(n) - 1).bit_length())
    triton.language = language

    def names(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Type(name)

    language.__getattr__ = names  # tl.constexpr, tl.int64, tl.program_id, ... (module-level __getattr__)
    return {"triton": triton, "triton.language": language}


def triton_version() -> str | None:
    """The installed triton's version ("installed" when it has no metadata); None where triton is missing."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "installed"


@contextlib.contextmanager
def stand_in_triton(owner: str, prefix: str, extra: dict[str, types.ModuleType] | None = None):
    """While the block runs: the stand-in triton where triton is missing, and `extra` (more stand-in modules, by
    name); afterwards sys.modules is as before. `prefix`: the library's own modules, which may keep them."""
    stub = {} if triton_version() is not None else triton_modules(owner)
    stub.update(extra or {})
    if not stub:
        yield
        return
    for name in TORCH_FIRST:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this torch: then it probes nothing
            pass
    held = {name: sys.modules.get(name) for name in stub}
    sys.modules.update(stub)
    try:
        yield
    finally:
        for name, before in held.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
    stubs = list(stub.values())
    leaked = sorted(name for name, module in list(sys.modules.items()) if module is not None
                    and not name.startswith((prefix, "triton")) and name not in stub
                    and any(value is s for value in list(vars(module).values()) for s in stubs))
    if leaked:  # a module outside the library kept the stand-in: say so rather than let it misbehave later
        raise RuntimeError(f"an import stand-in ({', '.join(sorted(stub))}) leaked into {', '.join(leaked[:5])}; "
                           "install the package it stands in for")
