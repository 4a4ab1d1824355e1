"""The pieces the placement editor is drawn with; each updates only the widgets whose value changed.

- :class:`StageRows`: the per-stage table, one row per stage (name, parameter MB, device
  dropdown); the range table is :class:`tfnb.notebook.widgets.ranges.RangeRows`.
- :class:`MemoryBars`: one bar per device, memory needed against its cap.
- :func:`figures_html`, :func:`editor_text`: the predicted figures, and the text fallback.

They hold widgets, not state: the editor's traitlets are the state, and it calls ``show(...)``.
"""
from __future__ import annotations

import html
import math
from functools import partial

import ipywidgets as W

from tfnb.errors import TfnbError
from tfnb.names import AUTO, format_bytes, short_device
from tfnb.notebook.widgets.dataflow import device_colors

__all__ = ["StageRows", "MemoryBars", "figures_html", "editor_text", "one_line", "STYLE"]

# Classes used by the rows; the editor puts this <style> in its header (no network, no files).
STYLE = ("<style>.tfnb-over{background:#fde2e2;border-left:4px solid #c00}"
         ".tfnb-row,.tfnb-range{border-left:4px solid transparent}"
         ".tfnb-status-error{color:#c00}</style>")
_OVER_CLASS = "tfnb-over"


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception as one line: tfnb's own messages as they are, others with their type.

    Examples
    --------
    >>> one_line(KeyError("x"))
    "KeyError: 'x'"
    >>> from tfnb.errors import PlacementError
    >>> one_line(PlacementError("stage 'a'" + chr(10) + "  is lost"))
    "stage 'a' is lost"
    """
    text = " ".join(str(error).split()) or type(error).__name__
    if not isinstance(error, TfnbError):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class StageRows:
    """One row per stage: name, parameter MB, a device dropdown (short labels, full values).

    ``on_pick(stage, device)`` is called when the user picks a device; :meth:`show` sets the
    dropdowns without calling it back. With ``lazy=True`` the rows are made on first use
    (:meth:`build`, or reading ``dropdowns``/``boxes``/``names``): 200 dropdowns take most of a
    second to make, and the editor keeps them in a collapsed detail.

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> rows = StageRows(tiny("llama").chain, ["a", "b"], on_pick=print, lazy=True)
    >>> rows.show(dict.fromkeys(tiny("llama").chain.names, "b"), over=())
    >>> rows.built, rows.dropdowns["head"].value, rows.built
    (False, 'b', True)
    """

    def __init__(self, chain, devices, on_pick, lazy: bool = False):
        self._chain, self._devices = chain, list(devices)
        self._on_pick, self._syncing, self._built = on_pick, False, False
        self._colors = device_colors(devices)
        self._over: set[str] = set()
        self._shown: dict[str, str] = {}
        self._pending = None          # the last (assignment, over) shown before the rows existed
        self.widget = W.VBox([])
        if not lazy:
            self.build()

    @property
    def built(self) -> bool:
        """Whether the row widgets exist yet."""
        return self._built

    @property
    def dropdowns(self) -> dict:
        self.build()
        return self._dropdowns

    @property
    def boxes(self) -> dict:
        self.build()
        return self._boxes

    @property
    def names(self) -> dict:
        self.build()
        return self._names

    def build(self) -> None:
        """Make the rows (once) and show the last assignment given to :meth:`show`."""
        if self._built:
            return
        options = [(short_device(d), d) for d in self._devices]
        self._names, self._dropdowns, self._boxes = {}, {}, {}
        boxes = []
        for stage in self._chain:
            name = W.HTML(html.escape(stage.name), layout=W.Layout(width="150px"))
            size = W.Label(f"{stage.param_bytes / 1e6:,.2f}", layout=W.Layout(width="90px"))
            pick = W.Dropdown(options=options, layout=W.Layout(width="200px"))
            pick.observe(partial(self._picked, stage.name), "value")
            box = W.HBox([name, size, pick], layout=W.Layout(flex="0 0 auto"))  # no squashing
            box.add_class("tfnb-row")
            self._names[stage.name], self._dropdowns[stage.name], self._boxes[stage.name] = \
                name, pick, box
            boxes.append(box)
        head = W.HTML("<b>stage</b>", layout=W.Layout(width="150px"))
        header = W.HBox([head, W.HTML("<b>params MB</b>", layout=W.Layout(width="90px")),
                         W.HTML("<b>device</b>")])
        # Long chains scroll inside the table (ipywidgets 8 knows ``overflow``, not overflow_y).
        self.widget.children = [header, W.VBox(boxes, layout=W.Layout(
            max_height="460px", overflow="auto", flex_flow="column"))]
        self._built = True
        if self._pending is not None:
            self.show(*self._pending)
            self._pending = None

    def _picked(self, stage: str, change) -> None:
        if not self._syncing:
            self._on_pick(stage, change["new"])

    def show(self, assignment: dict, over, changed=None) -> None:
        """Show ``assignment``; mark the rows on ``over`` devices. Touches changed rows only."""
        if not self._built:
            self._pending = (assignment, over)
            return
        self._syncing = True
        try:
            for stage in assignment if changed is None else changed:
                device = assignment[stage]
                if self._shown.get(stage) != device:
                    self._dropdowns[stage].value = device
                    color = self._colors.get(device, "#ddd")
                    self._names[stage].value = (
                        f'<span style="border-left:10px solid {color};padding-left:4px">'
                        f"{html.escape(stage)}</span>")
                    self._shown[stage] = device
        finally:
            self._syncing = False
        for stage, device in assignment.items():
            bad = device in over
            if bad != (stage in self._over):
                box = self._boxes[stage]
                (box.add_class if bad else box.remove_class)(_OVER_CLASS)
                (self._over.add if bad else self._over.discard)(stage)

    def highlighted(self) -> list[str]:
        """Stages whose row is marked as being on an over-full device."""
        return [s for s in self.boxes if s in self._over]


class MemoryBars:
    """Per device, memory needed by its stages (parameters + KV cache) against its cap.

    Examples
    --------
    >>> from tfnb.placement import Prediction
    >>> bars = MemoryBars(["a"], {"a": 1e6})
    >>> bars.show(Prediction(1e-3, 1e3, 0, {"a": 2e6}, {"a": 1e6}))
    >>> bars.bars["a"].bar_style, bars.labels["a"].value
    ('danger', '2.00 MB of 1.00 MB: 1.00 MB over')
    """

    def __init__(self, devices, caps: dict):
        self.caps = dict(caps)
        self.bars, self.labels = {}, {}
        rows = []
        for dev in devices:
            bar = W.FloatProgress(min=0.0, max=1.0, value=0.0, description=short_device(dev),
                                  style={"description_width": "140px"},
                                  layout=W.Layout(width="420px"))
            label = W.Label("")
            self.bars[dev], self.labels[dev] = bar, label
            rows.append(W.HBox([bar, label]))
        self.widget = W.VBox(rows)

    def show(self, prediction) -> None:
        """Fill the bars from ``prediction.memory``."""
        top = max([1.0, *prediction.memory.values()])
        for dev, bar in self.bars.items():
            need, cap = float(prediction.memory.get(dev, 0)), float(self.caps[dev])
            scale = top if math.isinf(cap) else cap
            bar.max = max(scale, 1.0)
            bar.value = min(need, bar.max)
            over = need > cap
            bar.bar_style = "danger" if over else "warning" if need > 0.9 * cap else "success"
            text = f"{format_bytes(need, 'MB', 2)} of {format_bytes(cap, 'MB', 2)}"
            self.labels[dev].value = text + (f": {format_bytes(need - cap, 'MB', 2)} over"
                                             if over else "")


def figures_html(prediction, applied=None) -> str:
    """The predicted figures as one HTML line (and how they compare with ``applied``).

    Examples
    --------
    >>> from tfnb.placement import Prediction
    >>> "2 ms/token" in figures_html(Prediction(2e-3, 500.0, 256.0, bottleneck="compute on a"))
    True
    """
    p = prediction
    line = (f"predicted <b>{p.latency_s * 1e3:.3g} ms/token</b> latency, "
            f"<b>{p.throughput:.4g} tokens/s</b> {html.escape(p.rate_words())}, "
            f"<b>{format_bytes(p.bytes_per_token)}/token</b> across devices; "
            f"bottleneck: {html.escape(p.limit)}")
    if applied is not None and applied.prediction is not None:
        ratio = p.latency_s / applied.prediction.latency_s if applied.prediction.latency_s else 1
        line += f" <i>({ratio:.2f}x the applied plan's latency)</i>"
    return f'<div class="tfnb-figures">{line}</div>'


def editor_text(editor) -> str:
    """The editor as plain text (terminals, logs, ``print(editor)``).

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> from tfnb.notebook.widgets import PlacementEditor
    >>> print(editor_text(PlacementEditor(tiny("llama"), ["a"])))   # doctest: +ELLIPSIS
    PlacementEditor: tiny-llama, 4 stages, mode auto (optimal), objective latency
    stage    params MB  device
    embed    0.02       a
    ...
    Apply: ready
    status: optimal planner: 1 segment(s) on 1 device(s), ...
    """
    plan, chain = editor.plan, editor.model.chain
    rows = [("stage", "params MB", "device")] + [
        (s.name + (" !" if editor.assignment[s.name] in editor.over_memory else ""),
         f"{s.param_bytes / 1e6:,.2f}", short_device(editor.assignment[s.name])) for s in chain]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    mode = f"{AUTO} ({editor.planner})" if editor.mode == AUTO else editor.mode
    lines = [f"PlacementEditor: {editor.model.name}, {len(chain)} stages, mode {mode}, "
             f"objective {editor.objective}", *table]
    if plan is not None:
        lines += str(plan).split("\n")[1:]
    lines.append("Apply: " + (f"disabled ({editor.apply_disabled_reason})"
                              if editor.apply_disabled_reason else "ready"))
    if editor.status:
        lines.append(f"status: {editor.status}")
    return "\n".join(lines)
