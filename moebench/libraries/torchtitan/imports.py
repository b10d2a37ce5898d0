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

import contextlib
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
DATA_MODULES = {"datasets": ("Dataset", "load_dataset"), "datasets.distributed": ("split_dataset_by_node",),
                "torchdata": (), "torchdata.stateful_dataloader": ("StatefulDataLoader",),
                "torch.utils.tensorboard": ("SummaryWriter",)}
"""What torchtitan 0.3's trainer, data and metrics modules import at module level from its declared data / logging
dependencies (datasets, torchdata, tensorboard), name by name: its config registries import those modules, and
parsing a config uses none of these names. `import_torchtitan(..., data=True)` stands in for the ones missing here."""
DATA_PROVIDERS = {"datasets": "datasets", "datasets.distributed": "datasets", "torchdata": "torchdata",
                  "torchdata.stateful_dataloader": "torchdata", "torch.utils.tensorboard": "tensorboard"}
"""The distribution whose presence means the real module imports (torch.utils.tensorboard needs tensorboard)."""


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


class _DataStandIn:
    """A class or function of a missing data / logging module: defining a subclass of it works (torchtitan's data
    loader subclasses StatefulDataLoader), calling or instantiating it raises, naming itself."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is an import stand-in here (its package is not installed): "
                           f"pip install {' '.join(sorted(set(DATA_PROVIDERS.values())))}")


def _data_stand_in(module: str, name: str):
    if name[:1].isupper():
        return type(name, (_DataStandIn,), {"__module__": module})

    def missing(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} is an import stand-in here (its package is not installed): "
                           f"pip install {DATA_PROVIDERS[module]}")

    missing.__name__ = name
    return missing


def missing_data_packages() -> list[str]:
    """The data / logging packages torchtitan declares that are not importable here (has_module decides)."""
    from moebench.preload import has_module

    return sorted({DATA_PROVIDERS[m] for m in DATA_MODULES if not has_module(DATA_PROVIDERS[m])})


def _data_stub_modules() -> dict[str, types.ModuleType]:
    missing = set(missing_data_packages())
    out: dict[str, types.ModuleType] = {}
    for module, names in DATA_MODULES.items():
        if DATA_PROVIDERS[module] not in missing:
            continue
        stub = types.ModuleType(module)
        stub.__path__ = []  # a package: its submodules import
        for name in names:
            setattr(stub, name, _data_stand_in(module, name))
        out[module] = stub
    for module, stub in out.items():
        parent, _, leaf = module.rpartition(".")
        if parent in out:
            setattr(out[parent], leaf, stub)
    return out


def triton_kind() -> str:
    """What the rows run with: the installed triton's version, or STUB."""
    if importlib.util.find_spec("triton") is not None:
        try:
            return importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            return "installed"
    return STUB


def import_torchtitan(*modules: str, data: bool = False) -> None:
    """Import torchtitan's `modules`, with the stand-in triton only while they import when triton is missing (and,
    `data=True`, stand-ins for its declared data / logging packages missing here: DATA_MODULES)."""
    with standing_in(data=data):
        for name in modules:
            importlib.import_module(name)


@contextlib.contextmanager
def standing_in(*, data: bool = False):
    """While the block runs: the stand-in triton where triton is missing, and with `data` the data / logging
    stand-ins where their packages are missing; afterwards sys.modules is as before."""
    stub = {} if importlib.util.find_spec("triton") is not None else _stub_modules()
    if data:
        import torch.utils  # noqa: F401 - the stand-in torch.utils.tensorboard hangs off torch's own package

        stub.update(_data_stub_modules())
    if not stub:
        yield
        return
    for name in TORCH_FIRST:
        importlib.import_module(name)
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
    stubs = [m for m in stub.values()]
    leaked = sorted(name for name, module in list(sys.modules.items()) if module is not None
                    and not name.startswith(("torchtitan", "triton")) and name not in stub
                    and any(value is s for value in list(vars(module).values()) for s in stubs))
    if leaked:  # a module outside torchtitan kept the stand-in: say so rather than let it misbehave later
        raise RuntimeError(f"an import stand-in ({', '.join(sorted(stub))}) leaked into {', '.join(leaked[:5])}; "
                           "install the package it stands in for")
