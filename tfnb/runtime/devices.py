"""Checking an assignment of stages to TF devices.

Devices are plain strings. A partial spec such as ``"/device:CPU:1"`` or ``"CPU:1"`` names the
logical device it matches (preferring the client's own job when a cluster is connected); the
resolved assignment holds TF's full names from ``tf.config.list_logical_devices()``.
"""

from __future__ import annotations

import tensorflow as tf

from tfnb.errors import PlacementError
from tfnb.runtime.graphs import client_cpu

__all__ = ["resolve_device", "resolve_assignment", "even_split"]


def _spec_fields(spec: tf.DeviceSpec) -> dict:
    return {k: v for k, v in dict(job=spec.job, replica=spec.replica, task=spec.task,
                                  device_type=spec.device_type,
                                  device_index=spec.device_index).items() if v is not None}


def _own_job() -> str:
    """The job of this process's devices (``localhost``, or the client's job in a cluster)."""
    return tf.DeviceSpec.from_string(client_cpu()).job or "localhost"


def resolve_device(device, available: list[str] | None = None) -> str:
    """The full name of the logical device ``device`` names; PlacementError if none or several.

    Examples
    --------
    >>> resolve_device("CPU:0", ["/device:CPU:0"])
    '/device:CPU:0'
    >>> resolve_device("/device:CPU:7", ["/device:CPU:0"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfnb.errors.PlacementError: device '/device:CPU:7' is not a logical device: expected one of ...
    """
    if available is None:
        available = [d.name for d in tf.config.list_logical_devices()]
    if not isinstance(device, str) or not device.strip():
        raise PlacementError(f"device {device!r}: expected a TF device string such as "
                             f"{available[0]!r}")
    text = device.strip()
    if not text.startswith("/") and ":" in text and not text.lower().startswith("device"):
        text = "/device:" + text
    try:
        want = _spec_fields(tf.DeviceSpec.from_string(text))
    except ValueError as e:
        raise PlacementError(f"device {device!r} is not a TF device string ({e}): expected one "
                             f"of {available}") from None
    if "device_type" in want:
        want["device_type"] = want["device_type"].upper()
    matches = []
    for name in available:
        have = _spec_fields(tf.DeviceSpec.from_string(name))
        have.setdefault("job", _own_job() if "job" in want else "localhost")
        have.setdefault("replica", 0)
        have.setdefault("task", 0)
        if all(have.get(k) == v for k, v in want.items()):
            matches.append(name)
    if len(matches) > 1:  # a partial name means the client's own devices first
        own = _own_job()
        local = [m for m in matches if "/job:" not in m or f"/job:{own}/" in m]
        matches = local if len(local) == 1 else matches
    if len(matches) != 1:
        what = "is not a logical device" if not matches else f"is ambiguous ({matches})"
        raise PlacementError(f"device {device!r} {what}: expected one of {available}")
    return matches[0]


def even_split(names: list[str], devices: list[str]) -> dict[str, str]:
    """Contiguous, even split of ``names`` over ``devices`` (earlier devices take the extra).

    Examples
    --------
    >>> even_split(["embed", "block.0", "block.1", "head"], ["A", "B"])
    {'embed': 'A', 'block.0': 'A', 'block.1': 'B', 'head': 'B'}
    """
    n, k = len(names), len(devices)
    sizes = [n // k + (i < n % k) for i in range(k)]
    out, start = {}, 0
    for device, size in zip(devices, sizes):
        out.update({name: device for name in names[start:start + size]})
        start += size
    return out


def resolve_assignment(assignment, names: list[str]) -> dict[str, str]:
    """Check ``assignment`` (a dict stage -> device, or a list of devices) against ``names``.

    Returns stage -> full device name, in stage order. Raises PlacementError naming the first
    stage or device at fault.

    Examples
    --------
    >>> resolve_assignment(["/device:CPU:0"], ["embed", "head"])
    {'embed': '/device:CPU:0', 'head': '/device:CPU:0'}
    >>> resolve_assignment({"embed": "/device:CPU:0"}, ["embed", "head"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfnb.errors.PlacementError: stage 'head' has no device: the assignment must map every stage ...
    """
    available = [d.name for d in tf.config.list_logical_devices()]
    if isinstance(assignment, str):
        assignment = [assignment]
    if isinstance(assignment, (list, tuple)):
        if not assignment:
            raise PlacementError("assignment=[]: expected at least one device")
        if len(assignment) > len(names):
            raise PlacementError(f"{len(assignment)} devices for {len(names)} stages: expected "
                                 f"at most one device per stage")
        devices = [resolve_device(d, available) for d in assignment]
        return even_split(names, devices)
    if not isinstance(assignment, dict):
        raise PlacementError(f"assignment={assignment!r:.80}: expected a dict stage -> device "
                             "or a list of devices")
    unknown = [s for s in assignment if s not in names]
    if unknown:
        raise PlacementError(f"unknown stage {unknown[0]!r} in the assignment: expected stages "
                             f"of {names[:3] + ['...'] + names[-2:] if len(names) > 6 else names}")
    out = {}
    for stage in names:
        if stage not in assignment:
            raise PlacementError(f"stage {stage!r} has no device: the assignment must map every "
                                 f"stage of {names}")
        try:
            out[stage] = resolve_device(assignment[stage], available)
        except PlacementError as e:
            raise PlacementError(f"stage {stage!r}: {e}") from None
    return out
