"""Importing torchtitan here: its MoE modules import triton at module level (0.3: distributed/minimal_async_ep/
kernels.py, for its async all-to-all; 0.2: models/moe/kernels.py, for its token permutation), but no Triton kernel
runs on the CPU paths the rows take. triton is ~1 GB; moebench does not install it.

Where triton is missing, `import_torchtitan()` imports torchtitan with a stand-in `triton` visible only while
torchtitan's modules import: `triton.jit` returns a kernel that raises, naming itself, if it is ever launched (so a
row that reached one fails saying so, never computes something else); the stand-in leaves sys.modules right after,
so nothing imported later sees it, and whatever torch itself asks of triton is settled before it exists (its
dynamo and inductor modules are imported first). The rows record which triton they ran with (`TRITON`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types

TORCH_FIRST = ("torch._dynamo", "functorch.compile", "torch._inductor.ir", "torch._inductor.lowering",
               "torch._inductor.compile_fx", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
               "torch.distributed._functional_collectives", "torch.distributed.fsdp")
"""torch's modules that probe triton when they import: imported before the stand-in exists (they find none)."""
STUB = "import stand-in (no Triton kernel runs on CPU; launching one raises)"


class StubKernel:
    """What `triton.jit` gives under the stand-in: a kernel that raises when launched."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def _raise(self, *args, **kwargs):
        raise RuntimeError(f"Triton kernel {self.__name__} launched, but triton is not installed here (moebench "
                           "imported torchtitan with a stand-in triton: this path needs a GPU and triton)")

    __call__ = _raise

    def __getitem__(self, grid):
        return self._raise


class _Type:
    """A triton.language type or constexpr marker, for the annotations evaluated when a kernel is defined."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"tl.{self.name}"

    def __call__(self, *args, **kwargs):
        return _Type(f"{self.name}(...)")


def _stub_modules() -> dict[str, types.ModuleType]:
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **kwargs: StubKernel(fn) if fn is not None else StubKernel
    triton.autotune = lambda *args, **kwargs: StubKernel
    triton.heuristics = lambda *args, **kwargs: StubKernel
    triton.Config = _Type("Config")
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << max(0, (int(n) - 1).bit_length())
    triton.language = language
    for name in ("int1", "int8", "int16", "int32", "int64", "uint8", "uint32", "uint64", "float16", "bfloat16",
                 "float32", "float64", "constexpr", "tensor", "dtype"):
        setattr(language, name, _Type(name))
    language.pointer_type = _Type("pointer_type")
    return {"triton": triton, "triton.language": language}


def triton_kind() -> str:
    """What the rows run with: the installed triton's version, or STUB."""
    if importlib.util.find_spec("triton") is not None:
        try:
            return importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            return "installed"
    return STUB


def import_torchtitan(*modules: str) -> None:
    """Import torchtitan's `modules`, with the stand-in triton only while they import when triton is missing."""
    if importlib.util.find_spec("triton") is not None:
        for name in modules:
            importlib.import_module(name)
        return
    for name in TORCH_FIRST:
        importlib.import_module(name)
    stub = _stub_modules()
    held = {name: sys.modules.get(name) for name in stub}
    sys.modules.update(stub)
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        for name, before in held.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
    leaked = sorted(name for name, module in list(sys.modules.items()) if module is not None
                    and not name.startswith(("torchtitan", "triton"))
                    and any(value is stub["triton"] or value is stub["triton.language"]
                            for value in list(vars(module).values())))
    if leaked:  # a module outside torchtitan kept the stand-in: say so rather than let it misbehave later
        raise RuntimeError(f"the stand-in triton leaked into {', '.join(leaked[:5])}; install triton")
