"""The placement editor's widgets and their wiring: every handler calls one editor method.

Layout, top to bottom: header; mode / planner / objective controls; the stage table beside the
dataflow picture; memory bars; predicted figures; Apply with its status; export and load.
"""
from __future__ import annotations

import html
import json

import ipywidgets as W
from traitlets import link

from tfnb.errors import TfnbError
from tfnb.notebook.widgets.views import STYLE, MemoryBars, StageRows, one_line

__all__ = ["build"]


def _title(text: str) -> W.HTML:
    return W.HTML(f"<b>{html.escape(text)}</b>")


def build(editor) -> None:
    """Create ``editor``'s widgets, link them to its traits and set ``editor.children``.

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> from tfnb.notebook.widgets import PlacementEditor
    >>> editor = PlacementEditor(tiny("llama"), ["a", "b"])   # calls build(editor)
    >>> len(editor.children), editor._apply_w.description
    (10, 'Apply')
    """
    chain, topo = editor.model.chain, editor.topology
    n = len(topo.devices)
    header = W.HTML(f"{STYLE}<h4 style='margin:4px 0'>Placement of {html.escape(editor.model.name)}"
                    f": {len(chain)} stages, {n} device{'s' * (n != 1)}</h4>")
    mode_w = W.ToggleButtons(options=["auto", "manual"], description="mode",
                             tooltips=["a planner fills the rows", "edit the rows by hand"],
                             style={"button_width": "70px"})
    planner_w = W.Dropdown(options=["optimal", "greedy", "memory"], description="planner",
                           layout=W.Layout(width="200px"))
    objective_w = W.ToggleButtons(options=["latency", "throughput"], description="objective",
                                  style={"button_width": "100px"})
    for w, name in ((mode_w, "mode"), (planner_w, "planner"), (objective_w, "objective")):
        link((editor, name), (w, "value"))

    editor.rows = StageRows(chain, topo.devices, on_pick=editor.set_device)
    editor.bars = MemoryBars(topo.devices, dict(zip(topo.devices, topo.memory.tolist())))
    editor._svg_w = W.HTML(layout=W.Layout(margin="0 0 0 16px"))
    editor._figures_w = W.HTML()
    editor._apply_w = W.Button(description="Apply", button_style="primary", icon="check")
    editor._apply_w.on_click(lambda _: editor.apply())
    editor._status_w, editor._reason_w = W.HTML(), W.HTML()

    path_w = W.Text(value="plan.json", description="file", layout=W.Layout(width="320px"))
    save_w, load_w = W.Button(description="Save JSON"), W.Button(description="Load JSON")
    save_w.on_click(lambda _: _guarded(editor, editor.export_json, path_w.value))
    load_w.on_click(lambda _: editor.load(path_w.value))
    upload_w = W.FileUpload(accept=".json", multiple=False, description="Upload plan")
    upload_w.observe(lambda change: _load_upload(editor, change["new"]), "value")
    editor._download_w = W.HTML()
    box = W.Layout(width="95%", height="160px")
    editor._json_w = W.Textarea(description="JSON", layout=box, disabled=False)
    editor._python_w = W.Textarea(description="Python", layout=box, disabled=False)
    export = W.VBox([W.HBox([path_w, save_w, load_w, upload_w]), editor._download_w,
                     editor._json_w, editor._python_w])
    more = W.Accordion(children=[export], titles=("Export / load a plan",), selected_index=None)

    editor.children = [
        header, W.HBox([mode_w, planner_w]), objective_w,
        W.HBox([editor.rows.widget, W.VBox([_title("dataflow"), editor._svg_w])]),
        _title("memory per device (parameters + KV cache)"), editor.bars.widget,
        editor._figures_w, W.HBox([editor._apply_w, editor._status_w]), editor._reason_w, more]


def _guarded(editor, fn, *args) -> None:
    """Run a button's action; an OS or tfnb error becomes the editor's one-line error."""
    try:
        fn(*args)
    except (OSError, TfnbError) as e:
        editor._report(error=one_line(e))


def _load_upload(editor, files) -> None:
    """Load the plan of an uploaded JSON file (``FileUpload.value`` in ipywidgets 8)."""
    for item in files or ():
        try:
            data = json.loads(bytes(item["content"]).decode())
        except (ValueError, UnicodeDecodeError) as e:
            editor._report(error=f"plan refused: {item.get('name', 'upload')!r} is not JSON ({e})")
            continue
        editor.load(data)
