"""Rows whose labels or settings no console, file or report should take as they are."""
import dataclasses

from hostile.base import Base
from moebench.libraries.spec import Row, Settings


@dataclasses.dataclass(frozen=True)
class Big(Settings):
    blob: str = "x" * 8_000_000


def _adapter(name, **row):
    class Labels(Base):
        def rows(self, world_size, *, resume=False, user_config=None):
            fields = {"library": self.name, "model": "m", "backend": "-", "ep_mode": "-", **row}
            return [Row(world_size=world_size, **fields)]
    Labels.name = name
    return Labels()


DOTDOT = _adapter("dotdot", model="/..")
ESCAPE = _adapter("escape", backend="\x1b[31mred\x1b[0m")
NEWLINE = _adapter("newline", ep_mode="a\nb")
HUGE_SETTING = _adapter("huge-setting", settings=Big())
ESCAPE_FEATURE = _adapter("escape-feature", features=("ok", "\x1b]0;title\x07"))
