"""Network namespaces for the fault tests: hosts of a test network on this machine (root only).

`require()` skips a test where namespaces cannot be made; `link()` joins two namespaces with a
veth pair; `impair()` sets delay, rate or loss on a link's ends with tc netem where the kernel has
it, else with what it has (a tc tbf rate limit; iptables' statistic match for random loss, or a
DROP for a cut); `start()` runs kvsparse-server in a namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import kvsparse


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def require(first: str) -> None:
    """Skips unless root with ip and tc; then makes the namespace `first`."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root, ip and tc")
    if sh("ip", "netns", "add", first, check=False).returncode != 0:
        pytest.skip("cannot create network namespaces here")
    sh("ip", "-n", first, "link", "set", "lo", "up")


def add(ns: str) -> None:
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")


def link(a: tuple[str, str, str], b: tuple[str, str, str]) -> None:
    """A veth pair between (namespace, device, address/prefix) a and b, both ends up."""
    sh("ip", "link", "add", a[1], "netns", a[0], "type", "veth", "peer", "name", b[1], "netns", b[0])
    for ns, dev, addr in (a, b):
        sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def wait_up(ends: list[tuple[str, str]], timeout: float = 10.0) -> None:
    """Until the kernel reports every (namespace, device) up (about a second after it is set up;
    UCX lists only interfaces that are)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if all(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/operstate").stdout.strip() == "up"
               for ns, dev in ends):
            return
        time.sleep(0.1)


def have_netem(ns: str, dev: str) -> bool:
    """Whether this kernel has sch_netem (the probe's qdisc is removed by the next impair())."""
    return sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms",
              check=False).returncode == 0


def impair(ends: list[tuple[str, str]], netem: str | None = None, tbf: str | None = None,
           drop: float | None = None) -> None:
    """Clears every end's impairment, then sets one: `netem` (a tc netem spec, where the kernel has
    it), else `tbf` (a tc tbf spec) and/or `drop` (the share of outgoing packets dropped by
    iptables; 1: a cut). Nothing given: the link is clean."""
    for ns, dev in ends:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        sh("ip", "netns", "exec", ns, "iptables", "-F", "OUTPUT", check=False)
        if netem:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", *netem.split())
            continue
        if tbf:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *tbf.split())
        if drop is not None:
            rule = [] if drop >= 1 else ["-m", "statistic", "--mode", "random", "--probability", str(drop)]
            sh("ip", "netns", "exec", ns, "iptables", "-A", "OUTPUT", "-o", dev, *rule, "-j", "DROP")


def remove(*namespaces: str) -> None:
    for ns in namespaces:
        sh("ip", "netns", "del", ns, check=False)


def start(ns: str, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """kvsparse-server on the CPU engine in namespace `ns`, its stderr appended to `log`."""
    binary = kvsparse.grpc.local_server.find_server_binary()
    return subprocess.Popen(["ip", "netns", "exec", ns, binary, "--gpu=off", *flags],
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"))
