"""The live collective probe on real gloo ranks: it passes here, it catches wrong values, and a hang
fails within its timeout leaving no process behind."""

import time

import pytest
import torch
import torch.distributed as dist

from moebench.envcheck import probe
from moebench.envcheck.check import FAIL, OK

pytestmark = pytest.mark.multirank

HANG_TIMEOUT_S = 2.0
# launch gives hung ranks STACK_DUMP_WAIT_S (1 s) to dump their stacks before SIGKILL; the rest is
# process start-up on a loaded 2-core machine.
HANG_SLACK_S = 3.0


def _children():
    from helpers.warmcli import children_left

    return children_left()


def test_gloo_probe_passes_and_all_to_all_single_is_supported_on_cpu():
    check = probe.run_probe("gloo", timeout_s=30)
    assert check.status == OK, check.found
    # The finding the report relies on: gloo on CPU runs uneven all_to_all_single (expert parallelism).
    assert check.data["ops"]["all_to_all_single_uneven"]["ok"]
    assert set(check.data["ops"]) == set(probe.OPS)
    assert _children() == []


def _corrupting(name):
    """A rank function whose `name` collective delivers wrong values (a backend bug, simulated)."""
    def rank_fn(ctx):
        real = getattr(dist, name)

        def broken(output, *args, **kwargs):
            real(output, *args, **kwargs)
            for t in output if isinstance(output, list) else [output]:
                t.add_(1)

        setattr(dist, name, broken)
        try:
            return probe.probe_rank(ctx)
        finally:
            setattr(dist, name, real)
    return rank_fn


@pytest.mark.parametrize("collective, op", [
    ("all_reduce", "all_reduce"),
    ("all_gather", "all_gather_variable"),
    ("all_to_all_single", "all_to_all_single_uneven"),
])
def test_probe_fails_when_a_collective_returns_wrong_values(collective, op):
    check = probe.run_probe("gloo", timeout_s=30, rank_fn=_corrupting(collective))
    assert check.status == FAIL, check.found
    assert "2/3 collectives ok" in check.found and op in check.found
    assert [n for n in probe.OPS if not check.data["ops"][n]["ok"]] == [op]


def _rank_that_hangs(ctx):
    if ctx.rank == 1:
        time.sleep(3600)  # never joins the collective
    return probe.probe_rank(ctx)


def test_a_hanging_probe_fails_within_its_timeout_and_leaves_no_process():
    start = time.monotonic()
    check = probe.run_probe("gloo", timeout_s=HANG_TIMEOUT_S, rank_fn=_rank_that_hangs)
    elapsed = time.monotonic() - start
    assert check.status == FAIL and check.found.startswith("hung"), check.found
    assert 1 in check.data["stuck_ranks"]
    assert elapsed < HANG_TIMEOUT_S + HANG_SLACK_S, elapsed
    assert _children() == []


def test_probe_is_skipped_without_a_second_gpu_and_with_no_probe():
    checks = {c.id: c for c in probe.checks(enabled=False, timeout_s=30, gpu_count=0)}
    assert checks["probe.gloo"].status == checks["probe.nccl"].status == "skip"
    assert "--no-probe" in checks["probe.gloo"].found


def test_probe_refuses_to_join_a_torchrun_job(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    checks = probe.checks(enabled=True, timeout_s=30, gpu_count=0)
    assert all(c.status == "warn" and "torchrun" in c.found for c in checks)
    assert _children() == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for the NCCL probe")
def test_nccl_probe_passes_on_two_gpus():
    check = probe.run_probe("nccl", timeout_s=60)
    assert check.status == OK, check.found
