"""The emulated-piece rule: a row records every piece of the framework it runs in moebench's code instead of the
framework's (spec.Settings.emulated), and a failure such a piece could have produced is named `emulated-piece` (a
question, keeping the mechanism it would otherwise be named by), never the library's bug. Unit cases on
parity.final.on_emulated, then the whole runner on a two-rank adapter whose row fails the same way with and without
the declaration."""

from __future__ import annotations

import dataclasses

import pytest

from moebench.libraries.spec import BF16, Adapter, Emulated, Row, Settings
from moebench.parity.compare import Comparison, assertion
from moebench.parity.diagnosis import (
    EMULATED_PIECE,
    GRAD_LEFT_PARTIAL,
    REDUCTION_MECHANISMS,
    REPLICATED,
    ROUTER,
    ROUTER_DETACHED,
    make,
)
from moebench.parity.final import on_emulated

REDUCE = Emulated(piece="the framework's FSDP reduction", groups=(ROUTER, REPLICATED), mechanisms=REDUCTION_MECHANISMS)


def _failed(group: str) -> list[Comparison]:
    return [assertion("step 1: router gradient", False, rank=1, group=group)]


def test_a_reduction_mechanism_on_an_emulated_group_is_a_question():
    was = make(GRAD_LEFT_PARTIAL, "the router gradient is one TP rank's share")
    named = on_emulated(was, _failed(ROUTER), [REDUCE.record()])
    assert named["name"] == EMULATED_PIECE and named["details"]["was"] == was
    assert named["details"]["piece"] == "the framework's FSDP reduction"
    assert "not the library's bug" in named["sentence"] and "grad-left-partial" in named["sentence"]
    assert "rank 1's step 1: router gradient" in named["sentence"]


@pytest.mark.parametrize("diagnosis, group, emulated", [
    (make(ROUTER_DETACHED, "no gradient reaches the router"), ROUTER, [REDUCE.record()]),  # no reduction makes it
    (make(GRAD_LEFT_PARTIAL, "..."), "experts", [REDUCE.record()]),  # a group the piece does not feed
    (make(GRAD_LEFT_PARTIAL, "..."), ROUTER, None),  # nothing emulated
    (None, ROUTER, [REDUCE.record()]),  # a pass
])
def test_what_the_piece_cannot_produce_keeps_its_name(diagnosis, group, emulated):
    assert on_emulated(diagnosis, _failed(group), emulated) == diagnosis


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlainSettings(Settings):
    dense_grads: str = "reduced by the framework"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmulatingSettings(Settings):
    dense_grads: str = "reduced by moebench (the framework's FSDP, emulated)"

    def emulated(self) -> tuple[Emulated, ...]:
        return (REDUCE,)


def left_partial(ctx, row, opts) -> list:
    """Every rank's router gradient one TP rank's share: the failure an unreduced gradient gives."""
    failed = assertion("step 1: router gradient", False, rank=ctx.rank, group=ROUTER)
    failed.diagnosis = make(GRAD_LEFT_PARTIAL, "the router gradient is one TP rank's share")
    return [assertion("step 1: output", True, rank=ctx.rank, group="output"), failed]


class Emulating(Adapter):
    name = "emulating"
    import_name = "torch"
    dist_name = "torch"
    extra = "torch"
    runners = {BF16: left_partial}

    def version(self) -> str:
        return "test"

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        return [Row(library=self.name, model="tiny", backend=backend, ep_mode="tp", world_size=world_size, kind=BF16,
                    settings=settings, features=("bf16",))
                for backend, settings in (("framework", PlainSettings()), ("emulated", EmulatingSettings()))]


@pytest.mark.multirank
def test_the_runner_names_a_failure_in_an_emulated_piece_and_records_the_piece():
    from moebench.testing import run_rows

    by_backend = {r["backend"]: r for r in run_rows(Emulating(), world_size=2)}
    framework, emulated = by_backend["framework"], by_backend["emulated"]
    assert (framework["verdict"], framework["diagnosis_name"]) == ("fail", GRAD_LEFT_PARTIAL), framework
    assert "emulated" not in framework
    assert (emulated["verdict"], emulated["diagnosis_name"]) == ("fail", EMULATED_PIECE), emulated
    assert emulated["diagnosis"].startswith("emulated-piece: a question, not the library's bug: grad-left-partial")
    assert emulated["emulated"] == [REDUCE.record()]
