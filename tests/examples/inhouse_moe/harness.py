"""The in-house layer verified through moebench's layer harness: all the user writes (docs/adding-a-library.md).

    moebench verify-parity --adapter inhouse_moe.harness:ADAPTER -n 2     (with tests/examples on PYTHONPATH)
"""

from inhouse_moe.layer import InHouseMoE, sync_gradients
from moebench.testing import Layer


def build(rank, world_size, num_experts):
    return InHouseMoE(8, 16, num_experts, rank=rank, world_size=world_size)


ADAPTER = Layer(name="inhouse-layer", build=build, d_model=8, experts="experts", layout="contiguous",
                sync=sync_gradients)
