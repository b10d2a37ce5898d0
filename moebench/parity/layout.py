"""Where each expert lives under expert parallelism: local slot <-> global expert, for every layout.

The central idea of expert parallelism, defined once: E experts over ep_size expert-parallel ranks, L = E /
ep_size local slots each. Every adapter, check and reproduction script maps experts through ExpertLayout.
Stdlib only: the reproduction scripts (libraries/repro) paste this file in whole, so a script and the tool
name experts alike.

Orders of the experts over the ep ranks:
- CONTIGUOUS: ep rank e holds experts e*L .. e*L + L-1 (DeepSpeed, fairscale, transformers, torchtitan);
- STRIDED: ep rank e holds experts e, e + ep_size, e + 2*ep_size, ... (round-robin placement).
Orders of the ranks (which ep rank a global rank is, when W = ep_size x edp ranks hold the experts):
- expert before data (DeepSpeed's default): ep groups are runs of consecutive ranks, ep rank = rank % ep_size;
- data before expert (DeepSpeed's use_data_before_expert_parallelism): ep groups stride over the ranks,
  ep rank = rank // edp.
"""

from __future__ import annotations

import dataclasses

CONTIGUOUS = "contiguous"
STRIDED = "strided"
ORDERS = (CONTIGUOUS, STRIDED)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """num_experts over ep_size expert-parallel ranks, in `order`; `data_before_expert` for the rank order."""

    num_experts: int
    ep_size: int
    order: str = CONTIGUOUS
    data_before_expert: bool = False

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ValueError(f"{self.num_experts} experts do not split over ep_size {self.ep_size}")
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} is not one of {ORDERS}")

    @property
    def local_experts(self) -> int:
        """Slots per ep rank."""
        return self.num_experts // self.ep_size

    def global_expert(self, ep_rank: int, slot: int) -> int:
        """The global expert in local `slot` of `ep_rank`."""
        if not 0 <= slot < self.local_experts or not 0 <= ep_rank < self.ep_size:
            raise IndexError(f"slot {slot} of ep rank {ep_rank} is outside {self}")
        if self.order == STRIDED:
            return ep_rank + slot * self.ep_size
        return ep_rank * self.local_experts + slot

    def experts_of(self, ep_rank: int) -> list[int]:
        """The global experts `ep_rank` holds, slot by slot."""
        return [self.global_expert(ep_rank, slot) for slot in range(self.local_experts)]

    def home(self, expert: int) -> tuple[int, int]:
        """(ep rank, slot) holding global `expert`."""
        if self.order == STRIDED:
            return expert % self.ep_size, expert // self.ep_size
        return expert // self.local_experts, expert % self.local_experts

    def ep_rank_of(self, rank: int, world_size: int) -> int:
        """The ep rank of global `rank` among `world_size` ranks (world_size = ep_size x expert-data size)."""
        if world_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} does not divide world size {world_size}")
        return rank // (world_size // self.ep_size) if self.data_before_expert else rank % self.ep_size

    def global_name(self, name: str, prefix: str, ep_rank: int) -> str:
        """A parameter named "<prefix><slot>.<rest>" on `ep_rank` -> "<prefix><global expert>.<rest>" (other
        names unchanged)."""
        found = self.split_name(name, prefix)
        if found is None:
            return name
        slot, rest = found
        return f"{prefix}{self.global_expert(ep_rank, slot)}.{rest}"

    @staticmethod
    def split_name(name: str, prefix: str) -> tuple[int, str] | None:
        """(slot, rest) of "<prefix><slot>.<rest>"; None for a name that is no expert's."""
        if not name.startswith(prefix):
            return None
        slot, _, rest = name[len(prefix):].partition(".")
        return (int(slot), rest) if slot.isdigit() else None
