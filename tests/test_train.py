"""The shared loop and run driver, with a toy rank function (no MoE needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moebench import results
from moebench.errors import RunFailed
from moebench.loop import LoopSpec, train_loop
from moebench.train import execute_run


def _toy_rank(ctx, run_path, steps, fail_at):
    torch.manual_seed(0)
    w = torch.zeros(4, requires_grad=True)
    target = torch.arange(4.0)
    opt = torch.optim.SGD([w], lr=0.1)

    def step(i):
        if fail_at is not None and i == fail_at:
            raise RuntimeError("toy failure")
        loss = ((w - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if ctx.world_size > 1:
            dist.all_reduce(w.grad)
            w.grad /= ctx.world_size
        opt.step()
        return {"loss": loss.item(), "aux_loss": 0.0}

    writer = results.RunDir(Path(run_path)) if ctx.rank == 0 and run_path else None
    history = train_loop(step, LoopSpec(total_steps=2 * steps, steps_per_epoch=steps, tokens_per_step=4),
                         writer=writer, show_progress=False)
    return {"loss": history["loss"], "epoch_loss": history["epoch_loss"]}


def _run(world_size, steps=3, fail_at=None):
    return execute_run(kind="toy", name="t", config={"steps": steps}, world_size=world_size,
                       rank_fn=_toy_rank, rank_args=(steps, fail_at), timeout_s=60)


def test_single_process_run_writes_the_whole_layout():
    out = _run(1)
    files = sorted(p.name for p in out.run_path.iterdir())
    assert files == ["config.json", "env.json", "loss.png", "metrics.jsonl", "summary.json"]
    summary = results.read_json(out.run_path / "summary.json")
    assert summary["status"] == "ok"
    metrics = results.read_jsonl(out.run_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 7)) and metrics[-1]["epoch"] == 2
    assert summary["loss"]["first"] == metrics[0]["loss"] and summary["loss"]["last"] == metrics[-1]["loss"]
    assert len(summary["epoch_loss"]) == 2 and summary["loss"]["drop_pct"] > 0


@pytest.mark.multirank
def test_two_ranks_train_like_one_and_only_rank_zero_writes():
    one, two = _run(1), _run(2)
    assert results.read_jsonl(one.run_path / "metrics.jsonl") != []
    l1 = [m["loss"] for m in results.read_jsonl(one.run_path / "metrics.jsonl")]
    l2 = [m["loss"] for m in results.read_jsonl(two.run_path / "metrics.jsonl")]
    assert l1 == l2  # identical data on both ranks: averaging changes nothing, bit for bit
    assert len(list(two.run_path.parent.iterdir())) == 2  # one folder per run, not per rank


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.multirank)])
def test_a_failing_run_says_so_in_its_files(world_size):
    with pytest.raises(RunFailed, match="toy failure") as info:
        _run(world_size, fail_at=1)
    summary = results.read_json(info.value.run_path / "summary.json")
    assert summary["status"] == "failed" and "toy failure" in summary["error"]
    assert len(results.read_jsonl(info.value.run_path / "metrics.jsonl")) == 1  # the step before


def test_non_finite_loss_fails_the_loop():
    with pytest.raises(FloatingPointError, match="nan"):
        train_loop(lambda s: {"loss": float("nan")}, LoopSpec(total_steps=2, steps_per_epoch=2, tokens_per_step=1),
                   writer=None, show_progress=False)


def test_interrupted_run_is_recorded(monkeypatch):
    def interrupting_rank(ctx, run_path):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute_run(kind="toy", name="i", config={}, world_size=1, rank_fn=interrupting_rank)
    (run,) = results.latest_runs("toy")
    assert results.read_json(run / "summary.json")["status"] == "interrupted"


def test_sigterm_during_a_run_is_recorded_as_interrupted(tmp_path):
    """A single-process run killed politely (SIGTERM) still says so in summary.json."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import time\n"
        "from moebench.train import execute_run\n"
        "def slow(ctx, run_path):\n"
        "    print('running', flush=True)\n"
        "    time.sleep(600)\n"
        "execute_run(kind='toy', name='term', config={}, world_size=1, rank_fn=slow)\n")
    env = {**os.environ, "MOEBENCH_RESULTS": str(tmp_path / "results")}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "running"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    (run,) = results.latest_runs("toy", root=tmp_path / "results")
    assert results.read_json(run / "summary.json")["status"] == "interrupted"
