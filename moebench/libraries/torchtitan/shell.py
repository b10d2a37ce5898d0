"""torchtitan's model shape around one MoE, as its code walks a model: 0.2's apply_moe_ep_tp and the load-balancing
hook (`layers` of blocks with `moe_enabled` and `.moe`), and 0.3's parallelize functions (a Decoder: no embedding,
norm, output head or MTP layers, no weight tying, `parallelize` walking its torchtitan Modules). Imports torch only
when a shell is built (in the rank)."""

from __future__ import annotations

import functools


def one_block_model(moe):
    """torchtitan's model shape around one MoE (`layers` of blocks with `moe_enabled` and `.moe`): what its MoE
    parallelization (0.2's apply_moe_ep_tp) and load balancing hook walk."""
    return DecoderShell(moe)


@functools.lru_cache(maxsize=1)
def _shell_classes():
    import torch.nn as nn

    class Block(nn.Module):
        moe_enabled = True

        def __init__(self, moe) -> None:
            super().__init__()
            self.moe = moe

        def forward(self, x):
            return self.moe(x)

    class Shell(nn.Module):
        """torchtitan's Decoder as its parallelize functions read it, around one MoE block: `layers`, no embedding,
        norm, output head or MTP layers, no weight tying; `parallelize` is Module.parallelize's walk (the MoE is
        the only torchtitan Module in it)."""

        enable_weight_tying = False
        tok_embeddings = norm = lm_head = mtp_layers = None

        def __init__(self, moe) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"0": Block(moe)})

        def parallelize(self, parallel_dims) -> None:
            self.layers["0"].moe.parallelize(parallel_dims)

        def forward(self, x):
            return self.layers["0"](x)

    return Shell


def DecoderShell(moe):  # noqa: N802 - a class, built lazily (torch imported in the rank)
    return _shell_classes()(moe)
