"""A conformance row and the adapter protocol every library adapter implements (LIBRARY_API.md)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from moebench.parity.compare import Comparison


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One row of the conformance matrix: what to build and how to run it (picklable; data only)."""

    library: str
    """The adapter's name: "transformers", "fairscale", "deepspeed", ..."""
    model: str
    """The block or model family, e.g. "mixtral", "top2gate"."""
    backend: str
    """Expert backend: "eager", "grouped_mm", "batched_mm"; "-" when the library has no choice."""
    ep_mode: str
    """How the experts are spread: "all_to_all", "all_reduce", "ep=W", ...; "-" when none."""
    world_size: int
    """Ranks this row runs on."""
    features: tuple[str, ...] = ()
    """What else the row verifies, e.g. ("loss-curve",)."""

    def key(self) -> str:
        """The row's stable id, also its parity check's name: library/model/backend/ep_mode/wN."""
        return f"{self.library}/{self.model}/{self.backend}/{self.ep_mode}/w{self.world_size}"


class Adapter(Protocol):
    """One library: its rows, and how each runs on every rank (see LIBRARY_API.md)."""

    name: str
    import_name: str
    extra: str

    def version(self) -> str | None: ...

    def unavailable(self) -> str | None: ...

    def rows(self, world_size: int) -> list[Row]: ...

    def run_row(self, ctx, row: Row, opts) -> list[Comparison]: ...
