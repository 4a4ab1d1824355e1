"""Plain ``tf.distribute.Server`` processes on loopback, started as the TensorFlow recipe does
(one per task of one cluster spec, without ``tfnb worker``: no tfnb kernels in them).

A plain server listens on every interface: an nftables guard (``LoopbackGuard``) lets only
loopback traffic reach their ports while they run.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest


def wait_for_port(port: int, proc, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the plain TF server exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@contextlib.contextmanager
def plain_servers(n: int):
    """``n`` plain TF servers of one cluster; yields their ``127.0.0.1:port`` addresses."""
    from tfnb.cluster.local import free_ports
    from tfnb.cluster.security import LoopbackGuard
    from tfnb.errors import ClusterError

    ports = free_ports(n)
    try:
        guard = LoopbackGuard(ports)
    except ClusterError as e:
        pytest.skip(f"a plain TF server listens on every interface; no loopback guard here ({e})")
    addresses = [f"127.0.0.1:{p}" for p in ports]
    servers = []
    try:
        for i in range(n):
            code = ("import tensorflow as tf; tf.distribute.Server(tf.train.ClusterSpec("
                    f"{{'worker': {addresses!r}}}), job_name='worker', task_index={i}).join()")
            servers.append(subprocess.Popen(
                [sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}))
        for port, server in zip(ports, servers):
            wait_for_port(port, server)
        yield addresses
    finally:
        for server in servers:
            server.kill()
            server.wait(timeout=10)
        guard.close()
