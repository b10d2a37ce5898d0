"""Every stand-in moebench uses to run megatron-core's MoE path on a CPU, in this one module.

megatron-core's MoE layer, DDP, `finalize_model_grads`, optimizer and training schedule are CUDA code by
construction, but on the paths the rows take only a handful of calls need the device itself; each is stood in for
here, in the rank processes only, for the length of one row, and undone after (`in_rank`). Nothing else of
megatron-core is changed: its own code computes every number a row compares.

- CUDA streams, events and `synchronize`: no-op objects. CPU operations are synchronous, so waiting on a stream or
  an event has nothing to wait for; `Event.elapsed_time` raises (a timing needs CUDA).
- `torch.cuda.current_device()` answers the CPU device, and a tensor Megatron asks for on "cuda" (its optimizer's
  scalars, its schedule's token count, its clip's buffers) is made on the CPU; `Tensor.cuda()` returns the tensor;
  `Tensor.type()` of a CPU tensor names its CUDA type ("torch.cuda.FloatTensor": the optimizer's and the clip's
  type checks). A TorchFunctionMode, active in the rank for the row only.
- The all-to-all dispatcher's split sizes: on a GPU `maybe_move_tensor_to_cpu(as_numpy=True)` turns them into numpy
  arrays (it copies them off the device); on the CPU it leaves them tensors, which `all_to_all_single` refuses. The
  stand-in does what it does on a GPU: the copy to the host, and numpy where asked.
- megatron-core 0.16.1's router calls `te_general_gemm` when Transformer Engine is absent (moe_utils.py defines it
  only when TE imports): `NameError`. The stand-in defines it as None, which selects the router's own torch
  branch (`torch.mm`), the one written for that case (a finding in itself, see docs/libraries/megatron.md).
- `GroupedMLP` (0.16.1) runs its experts through the `grouped_gemm` CUDA extension (`gg.ops.gmm`): the stand-in is a
  Python grouped matmul (each expert's rows times its weight, concatenated), the same mathematics, with autograd.
- triton: 0.17+ import it at module level (transformer/moe/ops/paged_stash.py) for kernels no CPU row launches.
  Where it is missing, megatron-core is imported with the stand-in triton of libraries/triton_standin.py, which
  exists only while it imports (`import_megatron`): its `__version__` is "0.0.0", so Megatron's own version checks
  take their no-triton path, and a kernel launched through it raises, naming itself.
Everything not listed raises as CPU torch does (CUDA graphs, device properties, Transformer Engine's fused kernels:
Megatron itself refuses those without TE). Every row records `STANDINS` (and the triton in use) in its settings.

This module imports only the standard library, torch (megatron lazily) and triton_standin.py: `--repro` scripts
paste both whole.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

from moebench.libraries.triton_standin import stand_in_triton, triton_version  # @PASTED@

STANDINS = ("ranks only: cuda streams/events/synchronize no-ops; current_device, 'cuda' tensors -> cpu; "
            "Tensor.type() cuda names; a2a splits as numpy; te_general_gemm=None; Python grouped_gemm.gmm")
"""What every row records (`standins`): the stand-ins a row's ranks run with (module docstring)."""
TRITON_STUB = "import stand-in (megatron-core imports triton; no Triton kernel runs on CPU; launching one raises)"
_MISSING = object()


# ------------------------------------------------------------------ triton, at import only (0.17+)

def triton_kind() -> str:
    """The triton a row runs with: the installed version, or TRITON_STUB where megatron-core needs the stand-in,
    or "" where the installed megatron-core does not import triton."""
    version = triton_version()
    if version is not None:
        return version
    import os

    try:
        spec = importlib.util.find_spec("megatron.core") if importlib.util.find_spec("megatron") else None
    except (ImportError, ValueError):
        spec = None
    core = next(iter(spec.submodule_search_locations or ()), "") if spec is not None else ""
    needs = bool(core) and os.path.isfile(os.path.join(core, "transformer", "moe", "ops", "paged_stash.py"))
    return TRITON_STUB if needs else ""


def import_megatron(*modules: str) -> None:
    """Import megatron-core's `modules` (warnings of its import silenced: "Transformer Engine and Apex are not
    installed", which the rows say in their own words), with the stand-in triton only while they import when triton
    is missing (triton_standin.py: it never stays in sys.modules)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stand_in_triton("megatron-core", "megatron"):
            for name in modules:
                importlib.import_module(name)


# ------------------------------------------------------------------ CUDA calls, in the ranks only

class Stream:
    """A CUDA stream on the CPU: every wait is already satisfied (CPU operations are synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return 0


class Event:
    """A CUDA event on the CPU: recorded and waited on at once; timing raises."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        raise RuntimeError("a CUDA event timing needs CUDA (moebench's CPU stand-in for torch.cuda.Event)")


_MAIN_STREAM = Stream()


def _is_cuda(device) -> bool:
    import torch

    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _cuda_as_cpu_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")

    class CudaAsCpu(TorchFunctionMode):
        """Tensors asked for on "cuda" are made on the CPU; `Tensor.cuda()` is the tensor itself; `Tensor.type()` of
        a CPU tensor names its CUDA type."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = {**kwargs, "device": cpu}
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], cpu, *args[2:])
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            return func(*args, **kwargs)

    return CudaAsCpu()


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`maybe_move_tensor_to_cpu` as it behaves on a GPU: a copy on the host, as numpy where asked."""
    import torch

    if torch.is_tensor(tensor):
        tensor = tensor.to("cpu")
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _gmm(a, b, batch_sizes, trans_b: bool = False):
    """grouped_gemm.ops.gmm in Python: rows of `a` split by `batch_sizes`, each times its expert's weight."""
    import torch

    if a.device.type != "cpu" or b.device.type != "cpu":
        raise RuntimeError("moebench's Python grouped matmul stands in for grouped_gemm on the CPU only")
    sizes = [int(n) for n in batch_sizes]
    outs = [x @ (w.t() if trans_b else w) for x, w in zip(torch.split(a, sizes), b)]
    width = b.shape[1] if trans_b else b.shape[2]
    return torch.cat(outs) if outs else a.new_zeros((0, width))


@contextlib.contextmanager
def in_rank():
    """The rank-time stand-ins (module docstring) for one row, undone when it ends. Refuses to run outside a rank
    (no process group: the CLI's own process never gets them)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("megatron stand-ins are installed in the rank processes only (no process group here)")
    saved: list = []

    def put(owner, name: str, value) -> None:
        saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, types.ModuleType)
                      else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    put(torch.cuda, "current_device", lambda: torch.device("cpu"))
    put(torch.cuda, "Stream", Stream)
    put(torch.cuda, "Event", Event)
    put(torch.cuda, "current_stream", lambda device=None: _MAIN_STREAM)
    put(torch.cuda, "default_stream", lambda device=None: _MAIN_STREAM)
    put(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    put(torch.cuda, "synchronize", lambda device=None: None)
    put(torch.Tensor, "record_stream", lambda self, stream: None)
    import_megatron("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.token_dispatcher")
    moe_utils = sys.modules["megatron.core.transformer.moe.moe_utils"]
    token_dispatcher = sys.modules["megatron.core.transformer.moe.token_dispatcher"]
    grouped_gemm_util = None  # 0.17+ have no GroupedMLP, and no grouped_gemm_util
    if importlib.util.find_spec("megatron.core.transformer.moe.grouped_gemm_util") is not None:
        grouped_gemm_util = importlib.import_module("megatron.core.transformer.moe.grouped_gemm_util")
    if "te_general_gemm" not in vars(moe_utils):  # 0.16.1 without TE: NameError in the router (module docstring)
        put(moe_utils, "te_general_gemm", None)
    put(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host)
    if grouped_gemm_util is not None and grouped_gemm_util.grouped_gemm is None:
        ops = types.SimpleNamespace(gmm=_gmm)
        put(grouped_gemm_util, "grouped_gemm", types.SimpleNamespace(ops=ops))
        put(grouped_gemm_util, "ops", ops)
    mode = _cuda_as_cpu_mode()
    mode.__enter__()
    try:
        yield
    finally:
        mode.__exit__(None, None, None)
        for owner, name, before in reversed(saved):
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
