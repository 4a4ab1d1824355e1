"""Who can reach the TF servers tfnb starts, and a way to keep a local cluster to this machine.

TensorFlow's gRPC server binds ``0.0.0.0:PORT`` (hard-coded in ``grpc_server_lib.cc``), has no
authentication and no TLS, and executes whatever graph it is sent: anyone who can reach the port
can run code as the user who started it. That holds for every worker and for the server that
``tf.config.experimental_connect_to_cluster`` starts inside the client. tfnb cannot change the
bind address, so it (1) reports the listening scope of each server it starts, (2) warns once per
process when one is reachable beyond loopback, and (3) offers :class:`LoopbackGuard`, an nftables
table that drops every packet to those ports that does not arrive on the loopback interface.
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import shutil
import subprocess
import threading
import warnings

from tfnb.errors import ClusterError


class ExposedServerWarning(UserWarning):
    """A TF server started by tfnb accepts connections from other hosts."""


_ADVICE = ("TF servers run any code they are sent, without authentication. Keep them on an "
           "isolated network, reach remote workers through an SSH tunnel, or for a local cluster "
           "use LocalCluster(isolate=True) / %tfcluster local N --isolate (root + nftables).")
_warned = False


def _listen_addresses(port: int) -> list[str]:
    """Local addresses with a TCP socket in LISTEN state on ``port`` (Linux /proc/net)."""
    found = []
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    local, state = parts[1], parts[3]
                    hexaddr, hexport = local.split(":")
                    if state != "0A" or int(hexport, 16) != port:
                        continue
                    # each 32-bit word is stored in host (little-endian) byte order
                    raw = b"".join(bytes.fromhex(hexaddr[i:i + 8])[::-1]
                                   for i in range(0, width, 8))
                    found.append(str(ipaddress.ip_address(raw)))
        except (OSError, StopIteration):
            continue
    return found


def listening_scope(port: int) -> str:
    """Describe who can reach a listening port on this machine.

    Returns ``"loopback"``, ``"all interfaces (0.0.0.0)"``, ``"all interfaces ([::])"``, a list of
    addresses, or ``"unknown"`` when the socket table cannot be read.

    Examples
    --------
    >>> listening_scope(1)  # nothing listens on port 1
    'unknown'
    """
    addrs = _listen_addresses(port)
    if not addrs:
        return "unknown"
    if all(ipaddress.ip_address(a).is_loopback for a in addrs):
        return "loopback"
    for wildcard, label in (("0.0.0.0", "all interfaces (0.0.0.0)"),
                            ("::", "all interfaces ([::])")):
        if wildcard in addrs:
            return label
    return ", ".join(sorted(set(addrs)))


def is_exposed(scope: str) -> bool:
    return scope not in ("loopback", "unknown", "loopback (guarded)")


def warn_if_exposed(servers: dict[str, str]) -> bool:
    """Warn once per process when any of ``{server: scope}`` is reachable beyond loopback."""
    global _warned
    exposed = {name: scope for name, scope in servers.items() if is_exposed(scope)}
    if not exposed or _warned:
        return bool(exposed)
    _warned = True
    listed = "; ".join(f"{name} listens on {scope}" for name, scope in exposed.items())
    warnings.warn(f"{listed}. {_ADVICE}", ExposedServerWarning, stacklevel=3)
    return True


def _nft(script: str) -> None:
    res = subprocess.run(["nft", "-f", "-"], input=script, text=True, capture_output=True,
                         timeout=10)
    if res.returncode != 0:
        raise ClusterError(f"nft refused the loopback guard: {res.stderr.strip()}")


_seq = itertools.count(1)


class LoopbackGuard:
    """An nftables table that lets only loopback traffic reach the given TCP ports.

    Needs Linux, root and the ``nft`` command (Debian: ``apt-get install nftables``). Each guard
    has its own table, ``tfnb_<pid>_<n>``: closing one (one cluster) leaves every other guard of
    this process in place. :meth:`close` removes the table, and tables left by dead processes are
    removed when the next guard starts.

    Examples
    --------
    >>> guard = LoopbackGuard([2222, 2223])        # doctest: +SKIP
    >>> guard.add_ports([2224]); guard.close()     # doctest: +SKIP
    """

    def __init__(self, ports: list[int], *, name: str | None = None):
        if not shutil.which("nft"):
            raise ClusterError("isolate=True needs the nft command (Debian: apt-get install "
                               "nftables)")
        if os.geteuid() != 0:
            raise ClusterError("isolate=True needs root to install an nftables rule; run as root "
                               "or keep the machine on an isolated network")
        self.table = f"tfnb_{os.getpid()}_{name or next(_seq)}"
        self.ports: list[int] = []
        _remove_stale_tables()
        _nft(f"add table inet {self.table}\n"
             f"add chain inet {self.table} input "
             "{ type filter hook input priority -10; policy accept; }\n")
        self.add_ports(ports)

    def add_ports(self, ports: list[int]) -> None:
        new = [int(p) for p in ports if int(p) not in self.ports]
        if not new:
            return
        listed = ", ".join(str(p) for p in new)
        _nft(f'add rule inet {self.table} input iifname != "lo" tcp dport {{ {listed} }} drop\n')
        self.ports.extend(new)

    def close(self) -> None:
        if self.ports is not None:
            subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True,
                           timeout=10)
            self.ports = None

    def __repr__(self) -> str:
        return f"LoopbackGuard(table={self.table!r}, ports={self.ports})"


_client_lock = threading.Lock()
_client: LoopbackGuard | None = None


def client_guard() -> LoopbackGuard:
    """The guard of this process's own TF server (the one ``connect`` starts): one per process.

    TensorFlow cannot stop that server, so it keeps listening after every cluster is stopped;
    its port stays guarded until the process ends (the table is removed at exit, or by the next
    guard after a crash).
    """
    global _client
    with _client_lock:
        if _client is None or _client.ports is None:
            _client = LoopbackGuard([], name="client")
            atexit.register(_client.close)
        return _client


def client_guarded(port: int) -> bool:
    """Whether ``port`` (this process's TF server) is behind :func:`client_guard`."""
    guard = _client
    return guard is not None and guard.ports is not None and port in guard.ports


def _remove_stale_tables() -> None:
    res = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=10)
    for line in res.stdout.splitlines():
        name = line.split()[-1] if line.startswith("table inet tfnb_") else ""
        pid = name.removeprefix("tfnb_").split("_")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True,
                           timeout=10)
