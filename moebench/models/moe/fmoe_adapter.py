"""The `fmoe` backend: the real `fmoe.FMoETransformerMLP`, when it can run here.

fastmoe's kernels are CUDA-only (its `fmoe_cuda` extension) and its expert-parallel exchange needs
fastmoe built with NCCL (the default; `USE_NCCL=0` turns it off). `unusable_reason()` says which of
these is missing; asking for `--moe-impl fmoe` then fails with that reason.
"""

from __future__ import annotations

import torch

from moebench.errors import UserError

_GATE_NAMES = {"naive": "NaiveGate", "gshard": "GShardGate", "switch": "SwitchGate", "noisy": "NoisyGate"}


def unusable_reason(*, device: str = "cuda", world_size: int = 1) -> str | None:
    """None when real fmoe can run a layer on `device` with `world_size` expert-parallel ranks."""
    if not str(device).startswith("cuda"):
        return f"fmoe runs on CUDA only and the run uses --device {device}"
    if not torch.cuda.is_available():
        return "fmoe runs on CUDA only and torch sees no CUDA GPU here"
    try:
        import fmoe  # noqa: F401
        import fmoe_cuda
    except ImportError as exc:
        return (f"fastmoe is not importable ({exc}); build it from github.com/laekov/fastmoe with "
                "`python setup.py install` (it is on no package registry) and install dm-tree")
    if world_size > 1 and not hasattr(fmoe_cuda, "global_scatter"):
        return "this fastmoe build has no distributed experts (built with USE_NCCL=0); rebuild with NCCL >= 2.7.5"
    return None


def build_fmoe_mlp(*, num_expert: int, d_model: int, d_hidden: int, top_k: int, gate: str,
                   world_size: int = 1, group=None, device: str = "cuda"):
    """An fmoe.FMoETransformerMLP that returns (y, aux_loss) and names its parameter categories."""
    reason = unusable_reason(device=device, world_size=world_size)
    if reason is not None:
        raise UserError(reason, flag="--backend")
    import fmoe
    import fmoe.gates

    class FMoEMLP(fmoe.FMoETransformerMLP):
        """Same parameters and state_dict as fmoe's; forward adds the gate's aux loss."""

        param_category = staticmethod(lambda name: "experts" if name.startswith("experts.")
                                      else "gate" if name.startswith("gate.") else "other")

        def forward(self, inp):
            y = super().forward(inp)
            aux = self.gate.get_loss()
            return y, (aux.reshape(()) if aux is not None else y.new_zeros(()))

    return FMoEMLP(num_expert=num_expert, d_model=d_model, d_hidden=d_hidden, world_size=world_size,
                   moe_group=group, top_k=top_k, gate=getattr(fmoe.gates, _GATE_NAMES[gate]))
