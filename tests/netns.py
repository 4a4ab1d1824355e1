"""Test hosts on this machine: Linux network namespaces joined by a bridge in the root namespace.

Addresses come from 198.18.0.0/15 (RFC 2544, reserved for benchmarking, never routed on the
Internet); they exist only on interfaces these tests create and remove.
"""
from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "198.18.77"
BRIDGE = "tfnbbr0"


def unavailable() -> str:
    """Why namespaces cannot be used here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "the ip command (iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "add", "tfnbprobe"], capture_output=True, text=True,
                           timeout=10)
    if probe.returncode != 0:
        return f"ip netns add is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "tfnbprobe"], capture_output=True, timeout=10)
    return ""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=10)


class Hosts:
    """``n`` test hosts ``tfnbh1..n`` at 198.18.77.11.., the root namespace at 198.18.77.1."""

    def __init__(self, n: int):
        self.names = [f"tfnbh{i + 1}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{11 + i}" for i in range(n)]
        self.gateway = f"{SUBNET}.1"
        self.close()  # leftovers of an interrupted run
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for name, addr in zip(self.names, self.addresses):
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
            _ip("link", "add", f"{name}r", "type", "veth", "peer", "name", f"{name}n")
            _ip("link", "set", f"{name}n", "netns", name)
            _ip("link", "set", f"{name}r", "master", BRIDGE)
            _ip("link", "set", f"{name}r", "up")
            _ip("addr", "add", f"{addr}/24", "dev", f"{name}n", ns=name)
            _ip("link", "set", f"{name}n", "up", ns=name)
            _ip("link", "set", "lo", "up", ns=name)
            _ip("route", "add", "default", "via", self.gateway, ns=name)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down (its packets are dropped, nothing is refused)."""
        _ip("link", "set", f"{self.names[i]}r", "down")

    def mend(self, i: int) -> None:
        _ip("link", "set", f"{self.names[i]}r", "up")

    def popen(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], **kw)

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[i], *cmd], **kw)

    def close(self) -> None:
        for name in getattr(self, "names", []):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            _ip("link", "del", f"{name}r", check=False)
        _ip("link", "del", BRIDGE, check=False)
