"""Protocol functions that raise or return the wrong type."""
from hostile.base import Base, failing
from moebench.libraries.spec import PARITY


class ReproRaises(Base):
    name = "repro-raises"
    runners = {PARITY: failing}

    def repro_script(self, row, seed):
        raise RuntimeError("my repro_script is broken")


class ReproNotText(Base):
    name = "repro-not-text"
    runners = {PARITY: failing}

    def repro_script(self, row, seed):
        return 5


class SkipNotText(Base):
    name = "skip-not-text"

    def skip_reason(self, row):
        return 3


class SkipRaises(Base):
    name = "skip-raises"

    def skip_reason(self, row):
        raise KeyError("no such thing")


class Unavailable(Base):
    name = "unavailable"

    def unavailable(self):
        return "needs the in-house fabric library"


class NoRowsAtThree(Base):
    name = "no-rows-at-three"

    def rows(self, world_size, *, resume=False, user_config=None):
        return [] if world_size == 3 else super().rows(world_size)


class AllSkip(Base):
    name = "all-skip"

    def skip_reason(self, row):
        return "needs a GPU"


REPRO_RAISES, REPRO_NOT_TEXT = ReproRaises(), ReproNotText()
SKIP_NOT_TEXT, SKIP_RAISES, UNAVAILABLE = SkipNotText(), SkipRaises(), Unavailable()
NO_ROWS_AT_THREE, ALL_SKIP = NoRowsAtThree(), AllSkip()
