"""Start N ranks, run one function on each, and come back with every rank's result - or a reason.

Launch is environment-driven:
- under `torchrun` (RANK and WORLD_SIZE set) this process *is* one rank: the function runs here,
  and every rank's return value is gathered so that rank 0 can write results;
- otherwise `launch` starts `world_size` local ranks itself (fork on CPU: well under a second per
  rank; spawn when CUDA is used, since CUDA does not survive a fork).

Guarantees, whatever the function does:
- rendezvous through a TCPStore that rank 0 opens on port 0, so no fixed port and no clash
  with another run on the same machine; it and gloo's pairs listen on loopback only;
- a deadline: ranks still alive when it passes have their Python stacks dumped (faulthandler on
  SIGUSR1) and are killed; the result says "hung" and names them;
- the process-group timeout is shorter than the deadline, so a collective that waits on a dead
  peer raises inside the rank (and its traceback reaches the user) before the deadline kills it;
- a rank that raises: its rank number and traceback come back; the surviving ranks get a short
  grace period, then are dumped and killed; the rank that failed first (not a peer that lost its
  connection to it afterwards) is named as the cause;
- no process outlives the call: success, failure, hang, Ctrl-C or SIGTERM. Children die with the
  parent too (PR_SET_PDEATHSIG), so even a SIGKILLed parent leaves no orphan.

Over 400 lines: local ranks and torchrun ranks give the same guarantees (deadline, stacks of hung ranks,
errors back, no orphan); one module keeps both paths side by side.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from moebench import signals, tempdirs
from moebench.errors import RendezvousFailed, UserError
from moebench.orphans import descendants, die_with_parent, kill_processes, kill_tree, set_subreaper
from moebench.rankenv import debug, local_world_size, rank_threads
from moebench.rankenv import is_launched_rank as under_torchrun
from moebench.signals import sigterm_as_interrupt  # noqa: F401 - the run driver and parity use it from here

# After one rank fails, the others get this long to finish or fail on their own (their collective
# with the dead rank errors out in gloo quickly) before their stacks are dumped and they are killed.
FAILURE_GRACE_S = 5.0
# Time a rank gets to write its stacks after SIGUSR1 before SIGKILL.
STACK_DUMP_WAIT_S = 1.0
# The process-group timeout is this fraction of the deadline: collectives time out inside the
# ranks (with a Python traceback naming the collective) before the parent's deadline fires.
PG_TIMEOUT_FRACTION = 0.75
# listen() backlog of the rendezvous socket: every local rank (at most 64) may connect at once.
LISTEN_BACKLOG = 128
# What a rank raises when a peer it talks to has gone (that peer's failure is the cause, not this):
# gloo's pairs, the TCPStore client (the store lives in rank 0), torch's wrappers of both.
KNOCK_ON_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistNetworkError")



@dataclasses.dataclass(frozen=True, kw_only=True)
class RankContext:
    """What a rank knows about itself; passed as the first argument of the launched function."""

    rank: int
    """This process's rank in the default process group (0 .. world_size-1)."""
    world_size: int
    """Number of ranks in the default process group."""
    local_rank: int
    """Rank on this node (selects the GPU when the backend is NCCL)."""
    backend: str
    """The torch.distributed backend in use: "gloo" or "nccl"."""
    device: str
    """"cpu" for gloo, "cuda:<local_rank>" for NCCL."""
    under_torchrun: bool = False
    """True when an external launcher (torchrun, deepspeed) started this process."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass(kw_only=True)
class LaunchResult:
    """What came back from every rank."""

    status: str
    """"ok", "failed" (a rank raised or died), "hung" (deadline passed) or "interrupted"."""
    world_size: int
    backend: str
    returns: list[Any]
    """Per-rank return values (None for a rank that did not return)."""
    errors: dict[int, str]
    """rank -> traceback text, for ranks that raised or died."""
    stacks: dict[int, str]
    """rank -> Python stacks dumped before the rank was killed (hung or aborted ranks)."""
    stuck_ranks: list[int]
    elapsed_s: float
    label: str = ""
    failed_at: dict[int, float] = dataclasses.field(default_factory=dict)
    """rank -> wall-clock time its function raised (ranks that died without a result have none)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def failure_order(self) -> list[int]:
        """The ranks with errors, the cause first: one rank failing takes its peers down with it (a
        collective or the store's connection breaks under them), so errors that only say a peer went
        away come last, and among the rest the earliest failure leads."""
        def key(rank: int) -> tuple[bool, float, int]:
            knock_on = any(words in self.errors[rank] for words in KNOCK_ON_ERRORS)
            return knock_on, self.failed_at.get(rank, float("inf")), rank
        return sorted(self.errors, key=key)

    def cause(self) -> tuple[int, str] | None:
        """(rank, traceback) of the failure that started it, or None when no rank raised or died."""
        order = self.failure_order()
        return (order[0], self.errors[order[0]]) if order else None

    def describe(self) -> str:
        """A human explanation of a non-ok result: which ranks, what they said, where they were."""
        if self.ok:
            return f"{self.label or 'launch'}: ok on {self.world_size} rank(s)"
        lines = [f"{self.label or 'launch'}: {self.status} on {self.world_size} rank(s) after {self.elapsed_s:.1f} s"]
        if self.stuck_ranks:
            lines.append(f"stuck ranks: {self.stuck_ranks}")
        order = self.failure_order()
        for rank in order:
            after = f" (after rank {order[0]} failed)" if rank != order[0] else ""
            lines.append(f"--- rank {rank} raised{after}:\n{self.errors[rank].rstrip()}")
        for rank, text in sorted(self.stacks.items()):
            lines.append(f"--- rank {rank} stacks when killed:\n{text.rstrip()}")
        return "\n".join(lines)


class LaunchError(RuntimeError):
    """Raised by `LaunchResult.check()`; carries the result for callers that want details."""

    def __init__(self, result: LaunchResult) -> None:
        self.result = result
        super().__init__(result.describe())


def check(result: LaunchResult) -> LaunchResult:
    if not result.ok:
        raise LaunchError(result)
    return result


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto" -> NCCL when CUDA has a GPU per local rank and NCCL is built in, else gloo."""
    if backend != "auto":
        return backend
    if (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= world_size
        and dist.is_nccl_available()
    ):
        return "nccl"
    return "gloo"


def gpu_shortfall(count: int, *, need_nccl: bool) -> str | None:
    """Why `count` local ranks cannot each have a CUDA GPU (and NCCL, when `need_nccl`), or None."""
    if not torch.cuda.is_available():
        return "needs CUDA GPUs and torch sees none here"
    found = torch.cuda.device_count()
    if found < count:
        return f"needs {count} CUDA GPUs (one per local rank) and torch sees {found}"
    if need_nccl and not dist.is_nccl_available():
        return "needs NCCL and this torch build has none"
    return None


def resolve_placement(world_size: int, device: str, comm_backend: str) -> tuple[str, str]:
    """(device, comm backend) with "auto" resolved for this machine; an impossible request is a
    UserError now, not a quiet fallback to CPU ranks after the run folder exists."""
    ranks = local_world_size(world_size)
    if device == "auto":
        device = "cuda" if gpu_shortfall(ranks, need_nccl=False) is None else "cpu"
    elif device == "cuda":
        shortfall = gpu_shortfall(ranks, need_nccl=False)
        if shortfall is not None:
            raise UserError(f"cuda on {ranks} local rank(s) {shortfall}; use --device cpu or auto", flag="--device")
    if comm_backend == "auto":
        comm_backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    elif comm_backend == "nccl":
        shortfall = gpu_shortfall(ranks, need_nccl=True) or (None if device == "cuda" else "needs --device cuda")
        if shortfall is not None:
            raise UserError(f"nccl on {ranks} local rank(s) {shortfall}; use --comm-backend gloo or auto",
                            flag="--comm-backend")
    return device, comm_backend


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "auto",
    timeout_s: float = 120.0,
    label: str = "",
    env: dict[str, str] | None = None,
    start_method: str | None = None,
) -> LaunchResult:
    """Run `fn(ctx: RankContext, *args)` on `world_size` ranks with a process group initialised.

    Never raises for a rank's failure or a hang: look at `result.status` (or call `check`).
    Ctrl-C / SIGTERM kill every rank and then propagate as KeyboardInterrupt.
    """
    if under_torchrun():
        return _run_as_torchrun_rank(fn, args, backend, timeout_s, label)
    backend = resolve_backend(backend, world_size)
    method = start_method or ("spawn" if backend == "nccl" else "fork")
    return _launch_local(fn, args, world_size, backend, timeout_s, label, env or {}, method)


# --------------------------------------------------------------------------- local ranks


def _launch_local(fn, args, world_size, backend, timeout_s, label, env, method) -> LaunchResult:
    start = time.monotonic()
    pg_timeout_s = max(1.0, timeout_s * PG_TIMEOUT_FRACTION)
    ctx = mp.get_context(method)
    workdir = tempdirs.make("launch")
    stack = contextlib.ExitStack()
    procs: list[mp.process.BaseProcess] = []
    status = "ok"
    stuck: list[int] = []
    # What the ranks' code starts never outlives the launch, even in a session of its own (start_new_session,
    # a daemon's double fork): each rank kills what is under it before it exits, and this process, a subreaper
    # for the launch, is handed what a killed rank left and kills it after.
    before = {c.pid for c in descendants(os.getpid())}
    was_subreaper = set_subreaper(True)
    try:
        stack.enter_context(sigterm_as_interrupt())
        # A forked rank never garbage-collects what it inherits: finalising an inherited object (a
        # destroyed process group still in a reference cycle) would wait forever on threads that did
        # not survive the fork. The rank freezes every object first thing (_child_main); no automatic
        # collection runs before that, since the fork happens with collection off. (This replaced a
        # gc.collect() here: 0.3 s of CPU per launch in a process that has imported the libraries.)
        collecting = gc.isenabled()
        gc.disable()
        try:
            for rank in range(world_size):
                p = ctx.Process(
                    target=_child_main,
                    args=(fn, args, rank, world_size, backend, pg_timeout_s, str(workdir), env, collecting),
                    name=f"moebench-rank{rank}",
                    daemon=False,
                )
                p.start()
                procs.append(p)
        finally:
            if collecting:
                gc.enable()
        deadline = start + timeout_s
        failed_at: float | None = None
        while True:
            signals.check()  # a safe point, every 0.5 s at most: Ctrl-C / SIGTERM kill every rank
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
            if now >= limit:
                status = "hung" if failed_at is None else "failed"
                # stuck: the ranks still there after their stacks were dumped; one that raised or
                # exited meanwhile (its collective timed out just after the deadline) was not stuck
                stuck = sorted(procs.index(p) for p in _dump_and_kill(alive))
                break
            mp.connection.wait([p.sentinel for p in alive], timeout=min(0.5, limit - now))
    except BaseException:  # Ctrl-C, SIGTERM, or a failure to start: no rank outlives this call
        _kill_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        _kill_all(procs)
        kill_processes([c for c in descendants(os.getpid()) if c.pid not in before])
        if was_subreaper is False:
            set_subreaper(False)
        # what the ranks made under moebench-tmp (a resume row's checkpoint) goes with them, whatever their end
        tempdirs.remove_owned_by(p.pid for p in procs if p.pid is not None)
        stack.close()
    returns: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    raised_at: dict[int, float] = {}
    stacks: dict[int, str] = {}
    for rank, p in enumerate(procs):
        payload = _read_payload(workdir, rank)
        if payload is not None and payload["ok"]:
            returns[rank] = payload["value"]
        elif payload is not None:
            errors[rank] = payload["error"]
            if "at" in payload:
                raised_at[rank] = payload["at"]
        stack_file = workdir / f"stacks{rank}.txt"
        stack_text = stack_file.read_text(errors="replace") if stack_file.exists() else ""
        if payload is None and rank not in stuck:
            # Killed by a signal or a fatal error (gloo aborts a rank on a collective mismatch):
            # faulthandler wrote its Python stack on the way down.
            errors[rank] = (f"rank {rank} died without a result ({_describe_exit(p.exitcode)})"
                            + (f"; its stack:\n{stack_text}" if stack_text else ""))
        if rank in stuck:
            stacks[rank] = stack_text or "(no stack written)"
    if status == "ok" and errors:
        status = "failed"
    shutil.rmtree(workdir, ignore_errors=True)
    return LaunchResult(
        status=status, world_size=world_size, backend=backend, returns=returns, errors=errors,
        stacks=stacks, stuck_ranks=stuck, elapsed_s=time.monotonic() - start, label=label, failed_at=raised_at,
    )


def _child_main(fn, args, rank, world_size, backend, pg_timeout_s, workdir, env, collecting=True) -> None:
    # Inherited objects are never garbage-collected here (see gc.disable in _launch_local).
    gc.freeze()
    if collecting:
        gc.enable()
    # A process group of its own: a deadline, failure or interrupt kills the rank with everything
    # it started (grandchildren included), not the rank alone.
    os.setpgid(0, 0)
    die_with_parent()
    set_subreaper(True)  # what its code starts and leaves behind comes back here, to be killed on the way out
    # Only the parent handles Ctrl-C; it kills the ranks. Ranks printing KeyboardInterrupt
    # tracebacks of their own would bury the one line that matters.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signals.reset()  # a signal the parent recorded before the fork is the parent's to act on
    # A rank's output is never moebench's result: keep stdout clean for `--json`. Only rank 0
    # talks; the others' prints are dropped unless --debug (their errors come back as payloads).
    if rank == 0 or debug():
        os.dup2(2, 1)
    else:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    os.environ.update(env)
    # torch reads TORCH_DISTRIBUTED_DEBUG once at import, which happened before the fork.
    dist.set_debug_level_from_env()
    stack_file = open(Path(workdir) / f"stacks{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # the deadline's dump
    faulthandler.enable(file=stack_file, all_threads=True)  # a fatal signal's dump (SIGABRT, SIGSEGV)
    # One intra-op thread in a forked rank: OpenMP's pool does not survive a fork once the parent
    # (a pytest process, the CLI after an in-process run) has started it; the child would hang in
    # its first matmul. Ranks an external launcher starts are fresh processes: see rank_threads.
    torch.set_num_threads(1)
    device = "cpu"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = _rendezvous(rank, Path(workdir), timeout)
        os.environ.update(_rank_env(rank, world_size, store.port))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, backend=backend, device=device)
        value = fn(ctx, *args)
        payload = {"ok": True, "value": value}
    except BaseException:  # noqa: BLE001 - everything a rank raises must reach the user
        payload = {"ok": False, "error": traceback.format_exc(), "at": time.time()}
    _write_payload(workdir, rank, payload)
    kill_tree(os.getpid(), include_root=False)  # the rank's code's children, wherever they moved
    try:
        if dist.is_initialized() and payload["ok"]:
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: gloo / NCCL destructors can block on dead peers.
        os._exit(0 if payload["ok"] else 1)


def _rendezvous(rank: int, workdir: Path, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0 opens the store on a port the OS picks and publishes it in the launch's private
    folder; the others wait for that file. (A store opened in the parent before fork would leave
    its server thread's sockets shared with every child.)"""
    port_file = workdir / "port"
    if rank == 0:
        store = _loopback_store(timeout)
        tmp = workdir / "port.tmp"
        tmp.write_text(str(store.port))
        os.replace(tmp, port_file)
        return store
    end = time.monotonic() + timeout.total_seconds()
    while not port_file.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"rank 0 did not publish the rendezvous port within {timeout.total_seconds():.0f} s")
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), None, False, timeout)


def _loopback_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous server, listening on 127.0.0.1 alone. TCPStore binds every interface (`::`)
    whatever host it is given, and it has no authentication: any host that reaches this machine
    could write keys, join or hang the rendezvous. So the socket is bound here, on a port the OS
    picks, and handed to the store (libuv's server listens on a descriptor it is given)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(LISTEN_BACKLOG)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def loopback_interface() -> str | None:
    """The name of the interface carrying 127.0.0.1 ("lo" on Linux), or None when there is none."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    # Code inside a rank (DeepSpeed, user code) may read the usual launcher variables.
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "MOEBENCH_LOCAL_LAUNCH": "1",
    }
    # gloo's pairs listen on the address the host name resolves to (a LAN address on many hosts)
    # or on GLOO_SOCKET_IFNAME: every rank is on this host, so loopback it is.
    loopback = loopback_interface()
    if loopback is not None:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _write_payload(workdir: str, rank: int, payload: dict) -> None:
    path = Path(workdir) / f"rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    try:
        data = pickle.dumps(payload)
    except Exception:  # noqa: BLE001 - an unpicklable return value is the function's bug
        data = pickle.dumps(
            {"ok": False, "error": f"rank {rank} returned an unpicklable value:\n{traceback.format_exc()}"}
        )
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_payload(workdir: Path, rank: int) -> dict | None:
    path = workdir / f"rank{rank}.pkl"
    if not path.exists():
        return None
    return pickle.loads(path.read_bytes())


def _dump_and_kill(procs: list) -> list:
    """Ask each rank for its stacks, give them STACK_DUMP_WAIT_S, kill them; the ranks that were
    still running at the end (not those that exited meanwhile)."""
    for p in procs:
        _signal(p, signal.SIGUSR1)
    end = time.monotonic() + STACK_DUMP_WAIT_S
    while time.monotonic() < end and any(p.exitcode is None for p in procs):
        time.sleep(0.05)
    still = [p for p in procs if p.exitcode is None]
    _kill_all(procs)
    return still


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.exitcode is None and p.pid is not None:  # its descendants, whatever group or session they are in
            kill_tree(p.pid, include_root=False)
        if p.pid is not None:  # the whole group, even when the rank itself has exited: its children
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        if p.exitcode is None:
            _signal(p, signal.SIGKILL)
    for p in procs:
        p.join(timeout=5)


def _signal(p, sig) -> None:
    try:
        if p.pid is not None:
            os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- torchrun


_RESULTS_GROUP = None
"""Under torchrun: the gloo group that carries every rank's return value (see below)."""


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_as_torchrun_rank(fn, args, backend, timeout_s, label) -> LaunchResult:
    """This process is one rank of an external launch: run here, gather returns to every rank."""
    start = time.monotonic()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = local_world_size(world_size)
    backend = resolve_backend(backend, local_world)
    global _RESULTS_GROUP
    if not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise UserError(f"RANK and WORLD_SIZE are set but {var} is not: start moebench under "
                                "torchrun, or unset RANK and WORLD_SIZE to let it start its own ranks")
        pg_timeout = datetime.timedelta(seconds=max(1.0, timeout_s * PG_TIMEOUT_FRACTION))
        if "nccl" in backend:  # "nccl" or a per-device string such as "cpu:gloo,cuda:nccl"
            torch.cuda.set_device(local_rank)
        dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG may have been set after import
        try:
            dist.init_process_group(backend, init_method="env://", timeout=pg_timeout)
        except (dist.DistError, RuntimeError) as exc:  # DistStoreError / DistNetworkError: no peer came
            where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RendezvousFailed(
                f"rank {rank} of {world_size} could not meet its peers at {where} within "
                f"{pg_timeout.total_seconds():.0f} s ({first}); start every rank (torchrun --nproc-per-node "
                f"{world_size} ...), or check MASTER_ADDR and MASTER_PORT") from None
        # Tear the group down before interpreter exit: a live gloo group aborts in its destructor.
        atexit.register(_destroy_process_group)
    if _RESULTS_GROUP is None:
        # Results travel on a group of their own: a rank that failed mid-function must not meet its
        # peers' pending collectives on the default group (gloo aborts on such a mismatch).
        _RESULTS_GROUP = dist.new_group(backend="gloo")
    device = f"cuda:{local_rank}" if "nccl" in backend else "cpu"
    torch.set_num_threads(rank_threads(local_world))  # torchrun sets 1 thread, the deepspeed launcher none
    ctx = RankContext(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend,
                      device=device, under_torchrun=True)
    # A hang inside fn: name it, dump every thread's stack and exit, so torchrun tears the job
    # down. (faulthandler's watchdog needs no GIL; the Timer only adds the line naming the work.)
    announce = threading.Timer(max(0.0, timeout_s - 0.2), lambda: print(
        f"[moebench rank {rank}] {label or 'launch'}: deadline of {timeout_s:.0f} s passed; "
        "stacks follow, then this rank exits", file=sys.stderr, flush=True))
    announce.daemon = True
    announce.start()
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        try:
            payload = {"ok": True, "value": fn(ctx, *args)}
        except Exception:  # noqa: BLE001
            payload = {"ok": False, "error": traceback.format_exc(), "at": time.time()}
            # Say it now: if a peer is stuck, the gather below waits for the group timeout.
            print(
                f"[moebench rank {rank}] {label or 'launch'} raised:\n{payload['error']}", file=sys.stderr, flush=True
            )
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, payload, group=_RESULTS_GROUP)
    finally:
        faulthandler.cancel_dump_traceback_later()
        announce.cancel()
    errors = {r: p["error"] for r, p in enumerate(gathered) if not p["ok"]}
    failed_at = {r: p["at"] for r, p in enumerate(gathered) if not p["ok"] and "at" in p}
    returns = [p["value"] if p["ok"] else None for p in gathered]
    return LaunchResult(
        status="failed" if errors else "ok", world_size=world_size, backend=backend, returns=returns,
        errors=errors, stacks={}, stuck_ranks=[], elapsed_s=time.monotonic() - start, label=label,
        failed_at=failed_at,
    )
