"""Importing torchtitan here: its MoE modules import triton at module level (0.3: distributed/minimal_async_ep/
kernels.py, for its async all-to-all; 0.2: models/moe/kernels.py, for its token permutation), but no Triton kernel
runs on the CPU paths the rows take. triton is ~1 GB; moebench does not install it.

Where triton is missing, `import_torchtitan()` imports torchtitan with the stand-in `triton` of
libraries/triton_standin.py, visible only while torchtitan's modules import: a kernel raises, naming itself, if it
is ever launched (so a row that reached one fails saying so, never computes something else); the stand-in leaves
sys.modules right after, so nothing imported later sees it. The rows record which triton they ran with (`TRITON`).
`standing_in(data=True)` adds stand-ins for torchtitan's data / logging packages missing here (DATA_MODULES).
"""

from __future__ import annotations

import contextlib
import importlib
import types

from moebench.libraries.triton_standin import stand_in_triton, triton_version  # @PASTED@

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
    return triton_version() or STUB


def import_torchtitan(*modules: str, data: bool = False) -> None:
    """Import torchtitan's `modules`, with the stand-in triton only while they import when triton is missing (and,
    `data=True`, stand-ins for its declared data / logging packages missing here: DATA_MODULES)."""
    with standing_in(data=data):
        for name in modules:
            importlib.import_module(name)


@contextlib.contextmanager
def standing_in(*, data: bool = False):
    """While the block runs: the stand-in triton where triton is missing, and with `data` the data / logging
    stand-ins where their packages are missing; afterwards sys.modules is as before (triton_standin.py)."""
    extra = {}
    if data:
        import torch.utils  # noqa: F401 - the stand-in torch.utils.tensorboard hangs off torch's own package

        extra = _data_stub_modules()
    with stand_in_triton("torchtitan", "torchtitan", extra):
        yield
