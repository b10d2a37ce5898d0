"""Runners that return what is no list of comparisons."""
from hostile.base import Base
from moebench.libraries.spec import PARITY


class ReturnsNone(Base):
    name = "returns-none"
    runners = {PARITY: lambda ctx, row, opts: None}


class ReturnsDict(Base):
    name = "returns-dict"
    runners = {PARITY: lambda ctx, row, opts: {"output": 1.0}}


class ReturnsNumbers(Base):
    name = "returns-numbers"
    runners = {PARITY: lambda ctx, row, opts: [1.0, 2.0]}


NONE, DICT, NUMBERS = ReturnsNone(), ReturnsDict(), ReturnsNumbers()
