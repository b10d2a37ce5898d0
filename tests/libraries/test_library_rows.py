"""The library room's plumbing: DeepSpeed's checks shown as rows (same comparisons, same verdicts,
a broken layer failing its row by name), and a broken adapter module that only marks its own library."""

from __future__ import annotations

import pytest

from moebench.libraries import matrix, registry
from moebench.libraries.records import rows_of
from moebench.parity.runner import ParityConfig, run_checks


def _row_checks(names, world_sizes):
    return matrix.row_checks(registry.require(names), world_sizes)


def _run(names, world_sizes, extra=()):
    with matrix.registered(_row_checks(names, world_sizes)) as checks:
        return run_checks(ParityConfig(world_size=max(world_sizes), timeout_s=60.0,
                                       checks=tuple(c.name for c in checks) + tuple(extra)))


@pytest.mark.multirank
def test_deepspeed_rows_are_its_checks():
    """The layer row is the deepspeed-moe-ep check; the engine rows are ds_engine's (tests/libraries/
    test_ds_engine.py runs them)."""
    pytest.importorskip("deepspeed")
    layer = [c for c in _row_checks(["deepspeed"], (2,)) if "moe.layer" in c.name]
    with matrix.registered(layer) as checks:
        summary = run_checks(ParityConfig(world_size=2, timeout_s=60.0,
                                          checks=tuple(c.name for c in checks) + ("deepspeed-moe-ep",)))
    by_name = {c["name"]: c for c in summary["checks"]}
    row, check = by_name["deepspeed/moe.layer.MoE/-/ep=2/w2"], by_name["deepspeed-moe-ep"]
    assert row["status"] == check["status"] == "pass"
    assert [c["name"] for c in row["comparisons"]] == [c["name"] for c in check["comparisons"]]
    rows = rows_of(summary)
    assert [(r["model"], r["backend"], r["ep_mode"], r["verdict"]) for r in rows] == [
        ("moe.layer.MoE", "-", "ep=2", "pass")]
    engine = [c.name for c in _row_checks(["deepspeed"], (2,)) if "/engine/" in c.name]
    # 3 stages x ep 2, 1 x (plain, grad-accum, clip, bf16, clip+bf16, fp16, clip+fp16, grad-accum+fp16), and
    # 3 stages at ep = W x (top-2, drops, residual, fp16+static-scale, fp16+overflow)
    assert "deepspeed/engine/zero1/ep=1/w2/clip" in engine and len(engine) == 3 * 2 * 8 + 3 * 5


@pytest.mark.multirank
def test_a_broken_deepspeed_layer_fails_its_row_by_name(monkeypatch):
    pytest.importorskip("deepspeed")
    from moebench.parity import checks_deepspeed

    build = checks_deepspeed.build_layer

    def summed(moe, *, experts, seed, ep_rank):  # expert gradients summed over the ranks (x W)
        layer = build(moe, experts=experts, seed=seed, ep_rank=ep_rank)
        if moe.ep_size > 1:
            for name, p in layer.named_parameters():
                if ".deepspeed_experts." in name:
                    p.register_hook(lambda g, n=moe.ep_size: g * n)
        return layer

    monkeypatch.setattr(checks_deepspeed, "build_layer", summed)
    with matrix.registered([c for c in _row_checks(["deepspeed"], (2,)) if "moe.layer" in c.name]) as checks:
        summary = run_checks(ParityConfig(world_size=2, timeout_s=60.0, checks=tuple(c.name for c in checks)))
    (row,) = rows_of(summary)
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "uniform-scale"
    assert "experts wrong" in row["diagnosis"]


def test_an_adapter_that_does_not_import_only_marks_its_library(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN, "brokenlib", "moebench.libraries.no_such_adapter_module:ADAPTER")
    monkeypatch.setattr(registry, "IMPORT_ERRORS", {})
    monkeypatch.setattr(registry, "_loaded", {})
    by_name = {s.name: s for s in registry.statuses()}
    assert by_name["brokenlib"].why_not.startswith("adapter did not import: no adapter module "
                                                   "moebench.libraries.no_such_adapter_module")
    assert all(s.version or s.why_not for n, s in by_name.items() if n != "brokenlib")  # the others still probed
    with pytest.raises(Exception, match="--library: brokenlib cannot run here"):
        registry.require(["brokenlib"])


def test_row_checks_leave_the_registry_as_they_found_it_and_a_library_without_rows_is_bad_input():
    from moebench.errors import UserError
    from moebench.libraries.spec import Adapter, Row
    from moebench.parity.registry import REGISTRY, load_all

    class Toy(Adapter):
        name, import_name, extra = "toylib", "torch", "toylib"
        runners = {"parity": "unused:run"}

        def rows(self, world_size, *, resume=False, user_config=None):
            return [Row(library="toylib", model="m", backend="-", ep_mode="-", world_size=world_size)] \
                if world_size > 1 else []

    before = set(load_all())
    checks = matrix.row_checks([Toy()], (2, 4))
    assert [(c.name, c.check.world_size) for c in checks] == [("toylib/m/-/-/w2", 2), ("toylib/m/-/-/w4", 4)]
    with matrix.registered(checks):
        assert {"toylib/m/-/-/w2", "toylib/m/-/-/w4"} <= set(REGISTRY)
    with pytest.raises(UserError, match="toylib has no rows at world size 1"):
        matrix.row_checks([Toy()], (1,))
    assert set(REGISTRY) == before
