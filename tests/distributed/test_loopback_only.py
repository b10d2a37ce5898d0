"""A run that starts its own ranks listens on loopback only: the rendezvous store included (issue 18, item 10).

TCPStore has no authentication: a store on every interface lets any host that can reach this machine
write keys into the rendezvous, join it or hang the run while it lasts."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.multirank


def _listening(tree: list[psutil.Process]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state held by the processes in `tree`."""
    found = set()
    for proc in tree:
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found |= {(c.laddr.ip, c.laddr.port, proc.pid) for c in conns if c.status == psutil.CONN_LISTEN}
    return found


def _lan_interface() -> str | None:
    """An interface with a non-loopback IPv4 address, if this host has one."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback for a in addrs):
            return name
    return None


@pytest.mark.parametrize("run", [
    # moebench starts two ranks: the rendezvous store and gloo's pairs
    ["fastmoe", "-n", "2", "--moe-impl", "reference", "--steps", "150"],
    # one process, DeepSpeed's comm on a one-rank gloo group (which listens too)
    ["deepspeed", "--preset", "quick", "--steps", "4"],
], ids=["fastmoe-2-ranks", "deepspeed-1-rank"])
def test_a_local_run_listens_on_loopback_only(tmp_path, run):
    # GLOO_SOCKET_IFNAME on a LAN interface stands for a host whose name resolves to a LAN address
    # (gloo's default device): the local ranks' pairs must stay on loopback all the same.
    lan = _lan_interface()
    cmd = [sys.executable, "-m", "moebench", "run", *run, "--results-dir", str(tmp_path / "results"), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **({"GLOO_SOCKET_IFNAME": lan} if lan else {})})
    root = psutil.Process(proc.pid)
    seen: set[tuple[str, int, int]] = set()
    ranks_seen = 0  # processes in the tree beyond the command itself
    world = int(run[run.index("-n") + 1]) if "-n" in run else 0
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        ranks_seen = max(ranks_seen, len(children))
        seen |= _listening([root, *children])
        time.sleep(0.05)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert ranks_seen >= world, "the ranks were never seen alive: the run was too short to observe"
    # The store / the gloo group listen for the whole run: seeing nothing would mean we looked wrong.
    assert seen, "no listening socket seen in the run's process tree"
    exposed = sorted(s for s in seen if not ipaddress.ip_address(s[0]).is_loopback)
    assert not exposed, f"listening beyond loopback (address, port, pid): {exposed}"


def _sockets_of_the_launch(ctx):
    """Rank 0 looks at every listening socket of the launch (the launcher and its ranks) while all are alive."""
    import torch.distributed as dist

    dist.barrier()  # every rank is in the group: the store and every gloo pair exist now
    found = None
    if ctx.rank == 0:
        parent = psutil.Process(os.getppid())
        found = sorted(_listening([parent, *parent.children(recursive=True)]))
    dist.barrier()
    return found


def test_the_launchers_sockets_are_on_loopback(monkeypatch):
    """moebench's own launch of 2 ranks (the rendezvous store and gloo's pairs), even with GLOO_SOCKET_IFNAME on a
    LAN interface: every listening socket is on loopback (the whole runs above are the slow tier's)."""
    from moebench.distributed.launch import launch

    lan = _lan_interface()
    if lan:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", lan)
    result = launch(_sockets_of_the_launch, 2, timeout_s=60)
    assert result.status == "ok", result.describe()
    seen = result.returns[0]
    assert seen, "no listening socket seen: we looked wrong"
    exposed = [s for s in seen if not ipaddress.ip_address(s[0]).is_loopback]
    assert not exposed, f"listening beyond loopback (address, port, pid): {exposed}"


def test_the_socket_check_sees_a_store_on_every_interface(monkeypatch):
    """The check above can fail: a store opened the plain way (TCPStore binds `::` whatever host it is given) is
    seen listening beyond loopback."""
    import datetime

    import torch.distributed as dist

    from moebench.distributed import launch as launch_module

    def plain_store(timeout: datetime.timedelta):
        return dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)

    monkeypatch.setattr(launch_module, "_loopback_store", plain_store)
    result = launch_module.launch(_sockets_of_the_launch, 2, timeout_s=60)
    assert result.status == "ok", result.describe()
    assert [s for s in result.returns[0] if not ipaddress.ip_address(s[0]).is_loopback]
