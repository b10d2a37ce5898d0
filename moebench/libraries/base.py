"""A conformance row and the adapter protocol every library adapter implements."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any, Protocol

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
    params: tuple[tuple[str, Any], ...] = ()
    """Library settings of the row as (name, value) pairs, e.g. (("zero_stage", 1), ("ep_size", 2)); each
    becomes a field of the row's JSON record (values: JSON scalars)."""
    variant: str = ""
    """What tells this row from its siblings with the same model/backend/ep_mode (e.g. "clip", "resume");
    appended to key() when not empty."""

    def key(self) -> str:
        """The row's stable id, also its parity check's name: library/model/backend/ep_mode/wN[/variant]."""
        base = f"{self.library}/{self.model}/{self.backend}/{self.ep_mode}/w{self.world_size}"
        return f"{base}/{self.variant}" if self.variant else base


class Adapter(Protocol):
    """One library: its rows, and how each runs on every rank (docs/libraries.md, "Adding a library")."""

    name: str
    """The library's name on the command line."""
    import_name: str
    """The module whose presence means the library is installed."""
    extra: str
    """The pip extra that installs it: `pip install 'moebench[<extra>]'`."""

    def version(self) -> str | None: ...

    def unavailable(self) -> str | None: ...

    def rows(self, world_size: int) -> list[Row]: ...

    def run_row(self, ctx, row: Row, opts) -> list[Comparison]: ...


def install_hint(extra: str) -> str:
    """The one command that installs a library's extra."""
    return f"pip install 'moebench[{extra}]'"


class InstalledLibrary:
    """version() / unavailable() from the distribution's metadata, never importing the library.

    Subclasses set name, import_name, extra, dist_name and add rows() / run_row()."""

    name = ""
    import_name = ""
    extra = ""
    dist_name = ""
    """The distribution name on PyPI (for importlib.metadata), e.g. "fairscale"."""

    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.dist_name or self.import_name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def unavailable(self) -> str | None:
        if importlib.util.find_spec(self.import_name) is None:
            return f"not installed: {install_hint(self.extra)}"
        return None
