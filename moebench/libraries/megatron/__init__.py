"""Megatron-core: listed, no rows. Its MoE layers need CUDA where moebench's rows run (a CPU with gloo), read from
megatron-core 0.16.1's wheel, not imported:

- `MoEAlltoAllTokenDispatcher.__init__` creates `torch.cuda.Stream()` (transformer/moe/token_dispatcher.py), so the
  dispatcher cannot even be built without CUDA;
- `Router.gating` moves a CPU router's weight and bias to `torch.cuda.current_device()` (transformer/moe/router.py)
  and allocates its routing tensors there.

Bridging either in the ranks would replace the code under test, so the rows belong to the GPU work (docs/gpu.md);
`--list` says so in one line, and `--library megatron` exits 2 with it.
"""

from __future__ import annotations

from moebench.libraries.spec import Adapter, Row

READ = "0.16.1"
"""The release the why-not describes (its wheel read, not installed)."""
WHY_NOT = (f"no rows on CPU: megatron-core {READ}'s MoEAlltoAllTokenDispatcher creates torch.cuda.Stream() in "
           "__init__ and Router.gating moves the router's weights to the CUDA device; its rows belong to the GPU work")
"""The one line --list prints, installed or not (nothing here runs its MoE)."""


class Megatron(Adapter):
    """Megatron-core: a why-not, no rows (see the module docstring)."""

    name = "megatron"
    import_name = "megatron.core"
    dist_name = "megatron-core"

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        return []

    def unavailable(self) -> str | None:
        return WHY_NOT


ADAPTER = Megatron()
