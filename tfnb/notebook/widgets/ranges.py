"""Placement by ranges: each device runs one contiguous range of stages, edited by its ends.

The pure functions here turn an assignment (stage -> device) into ranges and back;
:class:`RangeRows` shows them, one row per device with its first and last stage.

Rules of a range edit (:func:`with_range`, what ``PlacementEditor.set_range`` does):

- the device runs exactly the stages ``first .. last``; every other device keeps its stages
  outside that range, so moving one device's last stage moves the next device's first stage;
- stages the device gave up go to its neighbour on that side in the pipeline (the device before
  its old range for stages before ``first``, the one after for stages after ``last``; at either
  end of the chain, the neighbour on the other side);
- a range exactly equal to another device's range hands that range over (the other device drops
  out of the pipeline); any other range that would take all of a device's stages, or leave some
  device two separate runs, is refused, naming that device (so stepping a boundary never loses
  a device by accident: taking one out is explicit, ``set_range(device)`` or its row's button);
- an assignment where a device runs several separate runs (a hand-made or ``greedy`` plan) is
  first packed (:func:`pack`): devices in the order of their first stage, each keeping its
  number of stages. Editing by ranges therefore always gives a contiguous pipeline.
"""
from __future__ import annotations

import html
from functools import partial

import ipywidgets as W

from tfnb.errors import PlacementError
from tfnb.names import format_span, short_device
from tfnb.notebook.widgets.dataflow import device_colors

__all__ = ["stage_position", "device_runs", "pack", "with_range", "from_ranges", "RangeRows",
           "NONE"]

NONE = -1   # the range fields' value for "no stage" (an unused device)


def stage_position(names, stage, what: str = "stage") -> int:
    """The position in ``names`` of ``stage``, a stage name or a position (0 = the first stage).

    Examples
    --------
    >>> names = ["embed", "block.0", "block.1", "head"]
    >>> stage_position(names, "block.1"), stage_position(names, 3)
    (2, 3)
    >>> stage_position(names, "block.9", "last")
    Traceback (most recent call last):
    ...
    tfnb.errors.PlacementError: last='block.9': expected a stage name ('embed' .. 'head') or a \
position 0 .. 3
    """
    if isinstance(stage, str) and stage in names:
        return list(names).index(stage)
    n = len(names)
    if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage < n:
        return int(stage)
    raise PlacementError(f"{what}={stage!r}: expected a stage name ({names[0]!r} .. "
                         f"{names[-1]!r}) or a position 0 .. {n - 1}")


def device_runs(assignment: dict, names) -> dict[str, list[tuple[int, int]]]:
    """Each device's runs of consecutive stages as (first, last) positions, devices in chain order.

    Examples
    --------
    >>> device_runs({"embed": "a", "block.0": "b", "block.1": "b", "head": "a"},
    ...             ["embed", "block.0", "block.1", "head"])
    {'a': [(0, 0), (3, 3)], 'b': [(1, 2)]}
    """
    out: dict[str, list[tuple[int, int]]] = {}
    start = 0
    for k in range(1, len(names) + 1):
        if k == len(names) or assignment[names[k]] != assignment[names[start]]:
            out.setdefault(assignment[names[start]], []).append((start, k - 1))
            start = k
    return out


def pack(assignment: dict, names) -> list[str]:
    """The device of each position after packing: one run per device, in order of first stage,
    each device keeping its number of stages (a contiguous assignment is returned as it is).

    Examples
    --------
    >>> pack({"embed": "a", "block.0": "b", "block.1": "b", "head": "a"},
    ...      ["embed", "block.0", "block.1", "head"])
    ['a', 'a', 'b', 'b']
    """
    runs = device_runs(assignment, names)
    out: list[str] = []
    for dev, rs in runs.items():
        out += [dev] * sum(b - a + 1 for a, b in rs)
    return out


def _contiguity_error(devs: list[str], names) -> str | None:
    runs = device_runs(dict(zip(names, devs)), names)
    for dev, rs in runs.items():
        if len(rs) > 1:
            spans = ", ".join(format_span(names[a:b + 1]) for a, b in rs)
            return f"{short_device(dev)} would run {len(rs)} separate ranges ({spans})"
    return None


def with_range(assignment: dict, names, device: str, first=None, last=None) -> dict:
    """A new assignment where ``device`` runs exactly ``first .. last`` (see the module rules).

    ``first`` and ``last`` are stage names or positions; both None takes the device out of the
    pipeline (its stages go to the neighbour before it, or after it when it is first).

    Examples
    --------
    >>> names = ["embed", "block.0", "block.1", "head"]
    >>> a = dict(zip(names, "aabb"))
    >>> "".join(with_range(a, names, "a", "embed", "block.1").values())   # b's first moves too
    'aaab'
    >>> "".join(with_range(a, names, "c", "head", "head").values())       # a new device
    'aabc'
    >>> "".join(with_range(a, names, "b").values())                       # b drops out
    'aaaa'
    """
    names = list(names)
    n, devs = len(names), pack(assignment, names)
    old = [k for k, d in enumerate(devs) if d == device]
    who = short_device(device)
    if first is None and last is None:
        if not old:
            return dict(zip(names, devs))
        heir = devs[old[0] - 1] if old[0] > 0 else devs[old[-1] + 1] if old[-1] + 1 < n else None
        if heir is None:
            raise PlacementError(f"{who} runs every stage: give another device a range before "
                                 "taking it out of the pipeline")
        return dict(zip(names, [heir if d == device else d for d in devs]))
    if first is None or last is None:
        raise PlacementError(f"range of {who}: first={first!r}, last={last!r}: expected both "
                             "stages, or neither (to take the device out of the pipeline)")
    lo, hi = stage_position(names, first, "first"), stage_position(names, last, "last")
    if lo > hi:
        raise PlacementError(f"range of {who}: first={names[lo]!r} comes after "
                             f"last={names[hi]!r}: expected first <= last in chain order")
    new = list(devs)
    if old:
        before = devs[old[0] - 1] if old[0] > 0 else None
        after = devs[old[-1] + 1] if old[-1] + 1 < n else None
        for k in old:
            if k < lo:
                new[k] = before or after
            elif k > hi:
                new[k] = after or before
            if new[k] is None:
                raise PlacementError(
                    f"range of {who}: {format_span(names[lo:hi + 1])} leaves "
                    f"{format_span(names[:lo] if k < lo else names[hi + 1:])} with no device: "
                    f"{who} runs every stage; give another device a range first")
    new[lo:hi + 1] = [device] * (hi - lo + 1)
    for dev, rs in device_runs(dict(zip(names, devs)), names).items():
        if dev != device and dev not in new and rs != [(lo, hi)]:
            raise PlacementError(
                f"range of {who}: {format_span(names[lo:hi + 1])} takes every stage of "
                f"{short_device(dev)} ({format_span(names[rs[0][0]:rs[-1][1] + 1])}): expected "
                f"a range that leaves {short_device(dev)} a stage, or exactly its range (to hand "
                f"it over); the x button of its row takes it out of the pipeline")
    problem = _contiguity_error(new, names)
    if problem:
        raise PlacementError(f"range of {who}: {format_span(names[lo:hi + 1])}: {problem}; "
                             "expected a range that keeps each device's stages together (one "
                             "that starts or ends where another device's range does)")
    return dict(zip(names, new))


def from_ranges(names, ranges) -> dict:
    """An assignment from ``{device: (first, last)}`` (or ``[(device, first, last), ...]``)
    that covers every stage exactly once.

    Examples
    --------
    >>> names = ["embed", "block.0", "block.1", "head"]
    >>> from_ranges(names, {"a": ("embed", "block.0"), "b": (2, "head")})
    {'embed': 'a', 'block.0': 'a', 'block.1': 'b', 'head': 'b'}
    >>> from_ranges(names, {"a": ("embed", "block.0"), "b": ("head", "head")})
    Traceback (most recent call last):
    ...
    tfnb.errors.PlacementError: ranges: no device for 'block.1': expected ranges that cover \
every stage embed .. head (4) exactly once
    """
    names = list(names)
    items = list(ranges.items()) if isinstance(ranges, dict) else list(ranges)
    owner: list = [None] * len(names)
    for item in items:
        if isinstance(ranges, dict):
            device, span = item
            if not (isinstance(span, (tuple, list)) and len(span) == 2):
                raise PlacementError(f"ranges[{device!r}]={span!r}: expected (first, last)")
            first, last = span
        elif isinstance(item, (tuple, list)) and len(item) == 3:
            device, first, last = item
        else:
            raise PlacementError(f"ranges item {item!r}: expected (device, first, last)")
        lo, hi = stage_position(names, first, "first"), stage_position(names, last, "last")
        if lo > hi:
            raise PlacementError(f"range of {device!r}: first={names[lo]!r} comes after "
                                 f"last={names[hi]!r}: expected first <= last in chain order")
        for k in range(lo, hi + 1):
            if owner[k] is not None:
                raise PlacementError(f"ranges: {names[k]!r} is in the ranges of both "
                                     f"{owner[k]!r} and {device!r}: expected each stage once")
            owner[k] = device
    if None in owner:
        raise PlacementError(f"ranges: no device for {names[owner.index(None)]!r}: expected "
                             f"ranges that cover every stage {format_span(names)} exactly once")
    return dict(zip(names, owner))


class RangeRows:
    """One row per device: colour and name, first and last stage, a summary, a remove button.

    Rows are in pipeline order (the device running the first stage on top); devices that run
    nothing come last. The first and last stage are number fields holding stage positions
    (0 = the first stage; the summary names the stages; an unused device shows ``NONE``, -1):
    arrow keys step them one stage at a time, a typed position is sent on Enter or Tab. Number
    fields, not menus: JupyterLab leaves the keys of a focused text field to it, while a focused
    ``<select>`` would have ArrowUp/ArrowDown and letters run notebook commands.

    ``on_range(device, first, last)`` is called with the positions when the user changes a
    field (an unused device given one position gets that one stage), ``on_range(device, None,
    None)`` when the user clicks the device's remove button; :meth:`show` sets the fields
    without calling back.

    Examples
    --------
    >>> names = ["embed", "block.0", "block.1", "head"]
    >>> rows = RangeRows(names, ["a", "b"], on_range=print)
    >>> rows.show(dict(zip(names, "aabb")), over=())
    >>> rows.firsts["b"].value, rows.lasts["b"].value, rows.summaries["b"].value, rows.order
    (2, 3, 'block.1 .. head (2 stages)', ('a', 'b'))
    >>> rows.lasts["a"].value = 2                  # what the browser sends
    a 0 2
    """

    def __init__(self, names, devices, on_range):
        self.stage_names, self._on_range, self._syncing = list(names), on_range, False
        colors = device_colors(devices)
        self.boxes, self.firsts, self.lasts, self.summaries, self.removes = {}, {}, {}, {}, {}
        self.order: tuple[str, ...] = tuple(devices)
        self._over: set[str] = set()
        self._shown: dict[str, tuple] = {}
        n = len(self.stage_names)
        tip = f"stage position: 0 = {self.stage_names[0]} .. {n - 1} = {self.stage_names[-1]}"
        for dev in devices:
            label = W.HTML(f'<span style="border-left:10px solid {colors[dev]};padding-left:4px"'
                           f' title="{html.escape(dev)}">{html.escape(short_device(dev))}</span>',
                           layout=W.Layout(width="150px"))
            first, last = (W.IntText(value=NONE, continuous_update=False, tooltip=tip,
                                     layout=W.Layout(width="70px")) for _ in range(2))
            first.observe(partial(self._picked, dev, "first"), "value")
            last.observe(partial(self._picked, dev, "last"), "value")
            summary = W.HTML("", layout=W.Layout(width="230px"))
            remove = W.Button(icon="times", tooltip=f"take {short_device(dev)} out of the "
                              "pipeline (its stages go to the device before it)",
                              layout=W.Layout(width="32px"))
            remove.on_click(lambda _, dev=dev: self._on_range(dev, None, None))
            box = W.HBox([label, first, last, summary, remove], layout=W.Layout(flex="0 0 auto"))
            box.add_class("tfnb-range")
            self.boxes[dev], self.firsts[dev], self.lasts[dev], self.summaries[dev] = \
                box, first, last, summary
            self.removes[dev] = remove
        header = W.HBox([W.HTML("<b>device</b>", layout=W.Layout(width="150px")),
                         W.HTML("<b>first</b>", layout=W.Layout(width="70px")),
                         W.HTML("<b>last</b>", layout=W.Layout(width="70px")),
                         W.HTML("<b>stages</b>")])
        self.table = W.VBox([self.boxes[d] for d in devices], layout=W.Layout(
            max_height="460px", overflow="auto", flex_flow="column"))
        note = W.HTML(f'<small>first and last stage by position: 0 = '
                      f'{html.escape(self.stage_names[0])} .. {n - 1} = '
                      f'{html.escape(self.stage_names[-1])}; arrow keys step, Enter sends a '
                      'typed one</small>')
        self.widget = W.VBox([header, self.table, note])

    def _picked(self, device: str, end: str, change) -> None:
        if self._syncing:
            return
        first, last = self.firsts[device].value, self.lasts[device].value
        if self._shown.get(device, ((NONE, NONE),))[0] == (NONE, NONE):
            first = last = change["new"]           # an unused device: one stage to start with
        self._on_range(device, first, last)

    def show(self, assignment: dict, over, force: bool = False) -> None:
        """Show ``assignment``'s runs; mark devices in ``over``. Touches changed rows only
        (``force`` resets every field, e.g. after a refused edit left one on another value)."""
        names = self.stage_names
        runs = device_runs(assignment, names)
        order = tuple(runs) + tuple(d for d in self.boxes if d not in runs)
        self._syncing = True
        try:
            for dev in self.boxes:
                rs = runs.get(dev, [])
                shown = (rs[0][0], rs[-1][1]) if rs else (NONE, NONE)
                if force or self._shown.get(dev) != (shown, tuple(rs)):
                    self.firsts[dev].value, self.lasts[dev].value = shown
                    self.summaries[dev].value = html.escape(_summary(rs, names))
                    self.removes[dev].disabled = not rs
                    self._shown[dev] = (shown, tuple(rs))
        finally:
            self._syncing = False
        if order != self.order:
            self.order = order
            self.table.children = [self.boxes[d] for d in order]
        for dev, box in self.boxes.items():
            bad = dev in over
            if bad != (dev in self._over):
                (box.add_class if bad else box.remove_class)("tfnb-over")
                (self._over.add if bad else self._over.discard)(dev)

    def highlighted(self) -> list[str]:
        """Devices whose row is marked as over its memory cap."""
        return [d for d in self.order if d in self._over]


def _summary(runs, names) -> str:
    if not runs:
        return "unused: type a position to add it"
    n = sum(b - a + 1 for a, b in runs)
    count = f"{n} stage{'s' * (n != 1)}"
    if len(runs) == 1:
        a, b = runs[0]
        return f"{names[a]} .. {names[b]} ({count})" if a != b else f"{names[a]} ({count})"
    return f"{count} in {len(runs)} runs: " + ", ".join(
        names[a] if a == b else f"{names[a]} .. {names[b]}" for a, b in runs)
