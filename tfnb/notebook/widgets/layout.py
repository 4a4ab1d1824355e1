"""The placement editor's widgets and their wiring: every handler calls one editor method.

Layout, top to bottom: header; mode / planner / objective controls; the range table (one row per
device, first and last stage) over the collapsed per-stage detail, beside the dataflow picture;
memory bars; predicted figures; Apply with its status; export and load.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass
from functools import partial

import ipywidgets as W
from traitlets import link

from tfnb.errors import PlacementError, TfnbError
from tfnb.names import EDITOR_MODES, OBJECTIVES, PIPELINE_PLANNERS
from tfnb.notebook.widgets.ranges import RangeRows
from tfnb.notebook.widgets.views import STYLE, MemoryBars, StageRows, one_line

__all__ = ["build", "EditorWidgets"]


@dataclass(frozen=True)
class EditorWidgets:
    """The editor's widgets that show its state; the editor updates them, nothing else does.

    ``children`` is the editor's whole layout, top to bottom (these widgets and the controls
    that only forward user input to the editor).
    """

    ranges: RangeRows    # one row per device: first and last stage
    rows: StageRows      # one row per stage, built when ``detail`` is first opened
    detail: W.Accordion  # the collapsed per-stage detail
    export: W.Accordion  # "Export / load a plan": its views are filled while it is open
    bars: MemoryBars
    svg: W.HTML          # the dataflow picture
    figures: W.HTML      # predicted figures
    apply: W.Button
    status: W.HTML       # the last action's status or error
    reason: W.HTML       # why Apply is disabled
    download: W.HTML     # a data: link to the plan's JSON
    json: W.Textarea
    python: W.Textarea
    children: tuple


def _title(text: str) -> W.HTML:
    return W.HTML(f"<b>{html.escape(text)}</b>")


def build(editor) -> EditorWidgets:
    """Create ``editor``'s widgets, linked to its traits; the editor lays out ``children``.

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> from tfnb.notebook.widgets import PlacementEditor
    >>> editor = PlacementEditor(tiny("llama"), ["a", "b"])   # calls build(editor)
    >>> len(editor.children), editor.widgets.apply.description
    (10, 'Apply')
    """
    chain, topo = editor.model.chain, editor.topology
    n = len(topo.devices)
    header = W.HTML(f"{STYLE}<h4 style='margin:4px 0'>Placement of {html.escape(editor.model.name)}"
                    f": {len(chain)} stages, {n} device{'s' * (n != 1)}</h4>")
    mode_w = W.ToggleButtons(options=list(EDITOR_MODES), description="mode",
                             tooltips=["a planner fills the rows", "edit the rows by hand"],
                             style={"button_width": "70px"})
    planner_w = W.Dropdown(options=list(PIPELINE_PLANNERS), description="planner",
                           layout=W.Layout(width="200px"))
    objective_w = W.ToggleButtons(options=list(OBJECTIVES), description="objective",
                                  style={"button_width": "100px"})
    for w, name in ((mode_w, "mode"), (planner_w, "planner"), (objective_w, "objective")):
        link((editor, name), (w, "value"))

    ranges = RangeRows(chain.names, topo.devices, on_range=partial(_pick_range, editor))
    rows = StageRows(chain, topo.devices, on_pick=editor.set_device, lazy=True)
    detail = W.Accordion(children=[rows.widget], titles=(f"per-stage detail ({len(chain)} "
                                                         "stages)",), selected_index=None)
    detail.observe(lambda change: change["new"] is not None and rows.build(), "selected_index")
    bars = MemoryBars(topo.devices, dict(zip(topo.devices, topo.memory.tolist())))
    svg_w, figures_w = W.HTML(layout=W.Layout(margin="0 0 0 16px")), W.HTML()
    apply_w = W.Button(description="Apply", button_style="primary", icon="check")
    apply_w.on_click(lambda _: editor.apply())
    status_w, reason_w = W.HTML(), W.HTML()

    path_w = W.Text(value="plan.json", description="file", layout=W.Layout(width="320px"))
    save_w, load_w = W.Button(description="Save JSON"), W.Button(description="Load JSON")
    save_w.on_click(lambda _: _guarded(editor, editor.export_json, path_w.value))
    load_w.on_click(lambda _: editor.load(path_w.value))
    upload_w = W.FileUpload(accept=".json", multiple=False, description="Upload plan")
    upload_w.observe(lambda change: _load_upload(editor, change["new"]), "value")
    download_w = W.HTML()
    box = W.Layout(width="95%", height="160px")
    json_w = W.Textarea(description="JSON", layout=box, disabled=False)
    python_w = W.Textarea(description="Python", layout=box, disabled=False)
    export = W.VBox([W.HBox([path_w, save_w, load_w, upload_w]), download_w, json_w, python_w])
    more = W.Accordion(children=[export], titles=("Export / load a plan",), selected_index=None)
    more.observe(lambda change: change["new"] is not None and editor._show_export(),
                 "selected_index")

    children = (
        header, W.HBox([mode_w, planner_w]), objective_w,
        W.HBox([W.VBox([ranges.widget, detail]), W.VBox([_title("dataflow"), svg_w])]),
        _title("memory per device (parameters + KV cache)"), bars.widget,
        figures_w, W.HBox([apply_w, status_w]), reason_w, more)
    return EditorWidgets(ranges, rows, detail, more, bars, svg_w, figures_w, apply_w, status_w,
                         reason_w, download_w, json_w, python_w, children)


def _guarded(editor, fn, *args) -> None:
    """Run a button's action; an OS or tfnb error becomes the editor's one-line error."""
    try:
        fn(*args)
    except (OSError, TfnbError) as e:
        editor.report(error=one_line(e))


def _pick_range(editor, device: str, first, last) -> None:
    """A range typed in a row (stage positions; None, None: take the device out); a refused
    range becomes the editor's one-line error and the fields go back to the plan."""
    try:
        editor.set_range(device, first, last)
    except PlacementError as e:
        editor.report(error=one_line(e))
        editor.widgets.ranges.show(editor.assignment, editor.over_memory, force=True)


def _load_upload(editor, files) -> None:
    """Load the plan of an uploaded JSON file (``FileUpload.value`` in ipywidgets 8)."""
    for item in files or ():
        try:
            data = json.loads(bytes(item["content"]).decode())
        except (ValueError, UnicodeDecodeError) as e:
            editor.report(error=f"plan refused: {item.get('name', 'upload')!r} is not JSON ({e})")
            continue
        editor.load(data)
