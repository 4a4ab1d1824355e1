"""Health probes: ask a TF server for its devices with a deadline, without TensorFlow's client.

A probe is one ``tensorflow.WorkerService/GetStatus`` RPC over a fresh gRPC channel. Every TF
server answers it (workers started by ``tfnb worker`` or by a plain ``tf.distribute.Server``), and
it carries each device's name, type, memory limit and *incarnation* (a random number drawn when
the server starts, so a restarted worker is recognised). TensorFlow's own client has no timeout
for a worker that does not answer; this probe does, which is why tfnb asks it first.

States: ``up`` (answered), ``down`` (the host refused the connection: no server on that port),
``unresponsive`` (no answer within the timeout: host unreachable, link cut, process stopped).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

_METHOD = "/tensorflow.WorkerService/GetStatus"


@dataclass(frozen=True)
class DeviceInfo:
    """One device of a worker as its server reports it."""

    name: str  # e.g. /job:worker/replica:0/task:0/device:CPU:0
    device_type: str  # CPU, GPU, ...
    memory_limit: int  # bytes TF may use (meaningful for accelerators)
    incarnation: int

    @property
    def short(self) -> str:
        """``CPU:0`` from the full name."""
        return self.name.rsplit("device:", 1)[-1]


@dataclass(frozen=True)
class ProbeResult:
    address: str
    state: str  # up | down | unresponsive
    latency_s: float | None = None
    devices: tuple[DeviceInfo, ...] = field(default=())
    error: str = ""

    @property
    def incarnation(self) -> tuple[int, ...]:
        return tuple(d.incarnation for d in self.devices)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, i
        shift += 7


def _fields(buf: bytes):
    """Yield (field number, value) of a protobuf message (values: int or bytes)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def decode_status(payload: bytes) -> tuple[DeviceInfo, ...]:
    """Decode a ``GetStatusResponse`` (repeated ``DeviceAttributes`` in field 1)."""
    devices = []
    for number, value in _fields(payload):
        if number != 1:
            continue
        attrs = {n: v for n, v in _fields(value)}
        devices.append(DeviceInfo(
            name=attrs.get(1, b"").decode(),
            device_type=attrs.get(2, b"").decode(),
            memory_limit=int(attrs.get(4, 0)),
            incarnation=int(attrs.get(6, 0)),
        ))
    return tuple(devices)


def probe(address: str, timeout: float = 5.0) -> ProbeResult:
    """Ask the TF server at ``address`` for its devices; never blocks longer than ``timeout``.

    Examples
    --------
    >>> probe("127.0.0.1:1", timeout=1.0).state
    'down'
    """
    import grpc  # a TensorFlow dependency; importing it does not import TensorFlow

    start = time.perf_counter()
    # A fresh channel each time: a channel that once failed backs off and would report a
    # restarted worker as down for up to two minutes.
    channel = grpc.insecure_channel(address, options=[("grpc.enable_retries", 0)])
    try:
        call = channel.unary_unary(_METHOD, request_serializer=lambda m: m,
                                   response_deserializer=lambda b: b)
        payload = call(b"", timeout=timeout)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        # a process that just died may still reset the connection its listener had accepted
        reset = code == grpc.StatusCode.UNAVAILABLE and "reset by peer" in details.lower()
        refused = code == grpc.StatusCode.UNAVAILABLE and "refused" in details.lower()
        state = "down" if refused or reset else "unresponsive"
        reason = "connection refused" if refused else "connection reset" if reset else (
            f"no answer within {timeout:g} s" if code == grpc.StatusCode.DEADLINE_EXCEEDED
            else details.split(";")[-1].strip() or code.name)
        return ProbeResult(address, state, error=reason)
    finally:
        channel.close()
    latency = time.perf_counter() - start
    try:
        devices = decode_status(payload)
    except (ValueError, IndexError):
        return ProbeResult(address, "unresponsive", latency,
                           error="answered, but not like a TF server")
    return ProbeResult(address, "up", latency, devices)


def probe_all(addresses: list[str], timeout: float = 5.0) -> list[ProbeResult]:
    """Probe every address at once; returns within about ``timeout`` whatever the workers do."""
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        return list(pool.map(lambda a: probe(a, timeout), addresses))
