"""tfnb's vocabulary: the words a user chooses from, and how devices and byte counts read.

Plain data and two formatters, no TensorFlow, IPython or ipywidgets, so every layer (the core,
the magics, the widgets, the profiler) can share them:

- ``PLANNERS``: what ``tfnb.plan(..., mode=...)`` runs. ``PIPELINE_PLANNERS``: those that give a
  pipeline (one device per stage), which the placement editor offers.
- ``PLAN_MODES``: how a :class:`~tfnb.placement.Plan` was made, ``Plan.mode``: a planner or
  ``MANUAL`` (placed by hand).
- ``OBJECTIVES``: what the optimal planner minimises.
- ``EDITOR_MODES``: the placement editor's and ``%tfplace --mode``'s ``AUTO`` (a planner fills
  the rows) or ``MANUAL`` (rows edited by hand).
- :func:`short_device` labels a device the same way in every view (plans, widgets, profiles).
- :func:`format_bytes` writes a byte count in decimal units everywhere, :func:`format_count` a
  count of parameters or FLOPs, :func:`format_span` a run of consecutive stages.

Examples
--------
>>> "replicate" in PLANNERS, "replicate" in PIPELINE_PLANNERS, MANUAL in PLAN_MODES
(True, False, True)
>>> short_device("/job:worker/replica:0/task:1/device:CPU:0"), format_bytes(2304)
('worker:1/CPU:0', '2.3 kB')
"""
from __future__ import annotations

import math
import re

__all__ = ["PLANNERS", "PIPELINE_PLANNERS", "PLAN_MODES", "OBJECTIVES", "EDITOR_MODES", "AUTO",
           "MANUAL", "short_device", "format_bytes", "format_count", "format_span"]

MANUAL = "manual"
AUTO = "auto"
PIPELINE_PLANNERS = ("optimal", "greedy", "memory")
PLANNERS = PIPELINE_PLANNERS + ("replicate",)
PLAN_MODES = PLANNERS + (MANUAL,)
OBJECTIVES = ("latency", "throughput")
EDITOR_MODES = (AUTO, MANUAL)

_DEVICE = re.compile(r"/job:([^/]+)/replica:\d+/task:(\d+)(?:/device:(.+))?")
_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_SCALE = dict(_UNITS + (("B", 1),))


def short_device(device: str) -> str:
    """``/job:worker/replica:0/task:1/device:CPU:0`` -> ``worker:1/CPU:0``; others unchanged.

    A task without a device reads ``worker:1``. The label is what the placement editor accepts
    in place of the full name.

    Examples
    --------
    >>> short_device("/job:worker/replica:0/task:1/device:CPU:0")
    'worker:1/CPU:0'
    >>> short_device("/job:worker/replica:0/task:2"), short_device("/cpu:0")
    ('worker:2', '/cpu:0')
    """
    m = _DEVICE.fullmatch(device)
    if not m:
        return device
    task = f"{m.group(1)}:{m.group(2)}"
    return f"{task}/{m.group(3)}" if m.group(3) else task


def format_bytes(n: float, unit: str | None = None, decimals: int = 0) -> str:
    """``n`` bytes as text in decimal units (``"unlimited"`` for infinity).

    Without ``unit``, the largest unit ``n`` reaches with 3 significant digits; with ``unit``
    (``"B"``, ``"kB"``, ``"MB"``, ``"GB"``, ``"TB"``), always that unit, ``decimals`` places and
    thousands separators, so figures in one table or message line up.

    Examples
    --------
    >>> format_bytes(4), format_bytes(2304), format_bytes(3.5e6)
    ('4 B', '2.3 kB', '3.5 MB')
    >>> format_bytes(651_234_567, "MB"), format_bytes(1.5e5, "MB", 2), format_bytes(math.inf)
    ('651 MB', '0.15 MB', 'unlimited')
    """
    if math.isinf(n):
        return "unlimited"
    if unit is not None:
        if unit not in _SCALE:
            raise ValueError(f"unit={unit!r}: expected one of {list(_SCALE)}")
        return f"{n / _SCALE[unit]:,.{decimals}f} {unit}"
    for name, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.3g} {name}"
    return f"{n:.0f} B"


def format_count(n: float) -> str:
    """A count with an SI suffix (k, M, G, T) and 3 significant digits.

    Examples
    --------
    >>> format_count(1234567), format_count(512), format_count(2.5e12)
    ('1.23M', '512', '2.5T')
    """
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def format_span(stages) -> str:
    """A run of consecutive stages as its first and last name and its length.

    Examples
    --------
    >>> format_span(["embed", "block.0", "block.1"]), format_span(["head"])
    ('embed .. block.1 (3)', 'head')
    """
    return stages[0] if len(stages) == 1 else f"{stages[0]} .. {stages[-1]} ({len(stages)})"
