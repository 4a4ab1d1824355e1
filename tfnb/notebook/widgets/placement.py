"""``PlacementEditor``: choose, inspect and apply which device runs each stage of a model.

All state lives in traitlets (``mode``, ``planner``, ``objective``, ``assignment``, ``ranges``,
``plan``, ``apply_disabled_reason``, ``placed`` ...); the widgets only show it. Every change goes
through a few core methods (:meth:`PlacementEditor.replan`, :meth:`~PlacementEditor.set_range`,
:meth:`~PlacementEditor.set_ranges`, :meth:`~PlacementEditor.set_device`,
:meth:`~PlacementEditor.apply`, :meth:`~PlacementEditor.load`), which is also how code and tests
drive the editor without a browser.

The editor edits by ranges: one row per device with its first and last stage (the rules of a
range edit are in :mod:`tfnb.notebook.widgets.ranges`); the per-stage rows are a collapsed
detail, made when first opened.
"""
from __future__ import annotations

import base64
import contextlib
import html
import json
import os
import time

import ipywidgets as W
from traitlets import Any, Bool, Dict, Enum, Instance, Int, TraitError, Unicode, observe, validate

from tfnb.cluster import current
from tfnb.errors import PlacementError, TfnbError
from tfnb.names import (
    AUTO,
    EDITOR_MODES,
    MANUAL,
    OBJECTIVES,
    PIPELINE_PLANNERS,
    format_bytes,
    short_device,
)
from tfnb.notebook.widgets.dataflow import plan_svg
from tfnb.notebook.widgets.layout import build
from tfnb.notebook.widgets.ranges import device_runs, from_ranges, with_range
from tfnb.notebook.widgets.views import editor_text, figures_html, one_line
from tfnb.placement.apply import place
from tfnb.placement.cost import DEFAULT_CONTEXT_LEN, Topology, predict
from tfnb.placement.plan import Plan
from tfnb.placement.planners import as_topology
from tfnb.placement.planners import plan as make_plan

__all__ = ["PlacementEditor", "resolve_device", "read_plan", "apply_blocker"]


def resolve_device(device: str, devices) -> str:
    """The full name in ``devices`` of ``device``, a full name or a short label.

    Examples
    --------
    >>> resolve_device("worker:1/CPU:0", ["/job:worker/replica:0/task:1/device:CPU:0"])
    '/job:worker/replica:0/task:1/device:CPU:0'
    """
    if device in devices:
        return device
    full = [d for d in devices if short_device(d) == device]
    if len(full) == 1:
        return full[0]
    raise PlacementError(f"device {device!r} is not in the topology: expected one of "
                         f"{[short_device(d) for d in devices]}")


def read_plan(source) -> Plan:
    """A pipeline plan from a path, a dict from a plan JSON file, or a Plan.

    Examples
    --------
    >>> read_plan({"format": "tfnb.plan"})
    Traceback (most recent call last):
    ...
    tfnb.errors.PlacementError: uploaded plan has no 'mode': expected a file written by Plan.save
    """
    if isinstance(source, Plan):
        p = source
    elif isinstance(source, dict):
        p = Plan.from_dict(source, "uploaded plan")
    elif isinstance(source, (str, os.PathLike)):
        p = Plan.load(source)
    else:
        raise PlacementError(f"load({source!r:.60}): expected a path, a dict from a plan "
                             "JSON file, or a Plan")
    if p.replicas:
        raise PlacementError(f"the plan replicates the model on {len(p.replicas)} "
                             "devices: the editor edits pipelines (one device per stage)")
    return p


def apply_blocker(busy: bool, over_memory: dict) -> str:
    """Why Apply cannot run now (``""`` when it can): an Apply running, or a device over memory.

    Examples
    --------
    >>> apply_blocker(False, {"a": (2e6, 1e6)})
    'a would hold 2.00 MB but has 1.00 MB (1.00 MB over): move stages off it'
    """
    if busy:
        return "an Apply is running"
    if over_memory:
        dev, (need, cap) = next(iter(over_memory.items()))
        return (f"{short_device(dev)} would hold {format_bytes(need, 'MB', 2)} but has "
                f"{format_bytes(cap, 'MB', 2)} ({format_bytes(need - cap, 'MB', 2)} over): move "
                "stages off it")
    return ""


def format_span_of(runs) -> str:
    """``[("embed", "block.3"), ("head", "head")]`` as ``'embed .. block.3, head'``.

    Examples
    --------
    >>> format_span_of([("embed", "block.3"), ("head", "head")])
    'embed .. block.3, head'
    """
    return ", ".join(a if a == b else f"{a} .. {b}" for a, b in runs)


class PlacementEditor(W.VBox):
    """A widget to place a model's stages on a cluster's devices, automatically or by hand.

    Parameters
    ----------
    model : tfnb.models.Model
        The model to place (its ``.chain`` gives the stages).
    cluster : Cluster, Topology or list of str, optional
        Default: the connected cluster (:func:`tfnb.cluster.current`). A connected cluster is
        measured once (:func:`tfnb.placement.measure_topology`, cached per cluster); a Topology or
        a list of device names can be edited and exported but Apply needs a real cluster.
    max_memory : dict, optional
        ``{device: bytes or "512MB"}`` replacing the measured memory caps.
    mode, planner, objective, batch, context_len
        Initial values of the traits of the same names.
    route : {"auto", "kernel", "xla"}, optional
        How Apply places packed matrices (``tfnb.place``'s ``route``); the status line then
        names each device's route.

    Examples
    --------
    >>> from tfnb.models import tiny
    >>> editor = PlacementEditor(tiny("llama"), ["a", "b"], planner="greedy")
    >>> editor.plan.mode, editor.ranges
    ('greedy', {'a': [('embed', 'head')]})
    >>> plan = editor.set_range("b", "block.1", "head")   # editing switches to manual
    >>> editor.mode, editor.ranges
    ('manual', {'a': [('embed', 'block.0')], 'b': [('block.1', 'head')]})
    >>> plan = editor.set_device("block.0", "b")          # one stage, as in the detail rows
    >>> editor.ranges["b"], len(editor.rows.boxes)
    ([('block.0', 'head')], 4)
    """

    mode = Enum(EDITOR_MODES, AUTO, help="auto: a planner fills the rows; manual: edit "
                "rows (editing a row in auto switches to manual)")
    planner = Enum(PIPELINE_PLANNERS, "optimal",
                   help="planner used in auto mode (tfnb.plan's mode)")
    objective = Enum(OBJECTIVES, "latency",
                     help="what the optimal planner minimises: seconds per token or the slowest "
                          "pipeline stage")
    batch = Int(1, help="sequences per step the memory (KV cache) and figures are computed for")
    context_len = Int(DEFAULT_CONTEXT_LEN, help="tokens of context the KV cache is sized for")
    assignment = Dict(help="stage -> full TF device name, every stage in chain order")
    ranges = Dict(read_only=True, help="device -> [(first stage, last stage), ...]: each "
                  "device's runs, devices in chain order (one run each when contiguous)")
    plan = Instance(Plan, allow_none=True, read_only=True,
                    help="the current Plan (with its prediction), rebuilt on every change")
    over_memory = Dict(read_only=True, help="{device: (bytes needed, cap)} of over-full devices")
    apply_disabled_reason = Unicode("", read_only=True,
                                    help="why Apply is disabled now ('' when it is enabled)")
    busy = Bool(False, read_only=True, help="True while an Apply is running")
    placed = Any(None, read_only=True, help="the placed model of the last successful Apply")
    status = Unicode("", read_only=True, help="one line: the last action's progress or result")
    error = Unicode("", read_only=True, help="one line: the last action's error ('' if none)")
    model = Any(read_only=True, help="the model being placed")
    cluster = Any(None, read_only=True, help="the cluster Apply places on (None: none given)")
    topology = Instance(Topology, read_only=True, help="devices, memory caps, speeds and links")

    def __init__(self, model, cluster=None, *, max_memory=None, mode=AUTO, planner="optimal",
                 objective="latency", batch=1, context_len=None, route=None, **kwargs):
        chain = getattr(model, "chain", None)
        if not (hasattr(chain, "names") and hasattr(chain, "kv_bytes")):
            raise PlacementError(f"model={model!r:.60}: expected a tfnb model (from "
                                 "tfnb.load_model or tfnb.models.tiny) with a .chain")
        if route not in (None, "auto", "kernel", "xla"):
            raise PlacementError(f"route={route!r}: expected 'auto', 'kernel' or 'xla' (how "
                                 "packed matrices multiply, tfnb.place's route)")
        self.route = route
        if cluster is None:
            cluster = current()
        topology = as_topology(cluster, model, batch, context_len,
                               route=route).with_max_memory(max_memory)
        super().__init__(**kwargs)
        self._ready, self._auto_plan, self._applied_plan = False, None, None
        self._export_shown = None
        self._apply_callbacks = W.CallbackDispatcher()
        self.set_trait("model", model)
        self.set_trait("topology", topology)
        if hasattr(cluster, "devices") and hasattr(cluster, "status"):
            self.set_trait("cluster", cluster)
        self.batch, self.context_len = batch, DEFAULT_CONTEXT_LEN if context_len is None \
            else context_len
        self.objective, self.planner, self.mode = objective, planner, mode
        self.widgets = build(self)
        self.range_rows, self.rows = self.widgets.ranges, self.widgets.rows
        self.bars = self.widgets.bars
        self.children = self.widgets.children
        self.assignment = dict.fromkeys(chain.names, topology.devices[0])
        self._ready = True
        self._refresh(None)
        if self.mode == AUTO:
            self.replan()

    # --- invariants -----------------------------------------------------------------------
    @validate("assignment")
    def _valid_assignment(self, proposal):
        a, chain = proposal["value"], self.model.chain
        unknown = [s for s in a if s not in chain]
        missing = [s for s in chain.names if s not in a]
        if unknown or missing:
            what = f"unknown stage {unknown[0]!r}" if unknown else f"no device for {missing[0]!r}"
            raise TraitError(f"assignment: {what}: expected every stage of {chain.names[0]!r} .. "
                             f"{chain.names[-1]!r} ({len(chain)} stages) and no other")
        return {s: resolve_device(a[s], self.topology.devices) for s in chain.names}

    @validate("batch", "context_len")
    def _valid_load(self, proposal):
        low = 1 if proposal["trait"].name == "batch" else 0
        if proposal["value"] < low:
            raise TraitError(f"{proposal['trait'].name}={proposal['value']!r}: expected an "
                             f"integer >= {low}")
        return proposal["value"]

    # --- reactions (each calls one core method) ---------------------------------------------
    @observe("mode")
    def _on_mode(self, change):
        if self._ready and change["new"] == AUTO:
            self.replan()
        elif self._ready and self.plan is not None and self.plan.mode != MANUAL:
            self._refresh(())

    @observe("planner")
    def _on_planner(self, change):
        if self._ready and self.mode == AUTO:
            self.replan()
        elif self._ready:
            self.mode = AUTO   # picking a planner means: let it plan

    @observe("objective", "batch", "context_len")
    def _on_load(self, change):
        if self._ready and self.mode == AUTO:
            self.replan()
        elif self._ready:
            self._refresh(())

    @observe("assignment")
    def _on_assignment(self, change):
        old, new = change["old"] or {}, change["new"]
        if self._ready:
            self._refresh([s for s in new if old.get(s) != new[s]] if old else None)
            if self.mode == AUTO and self.plan.mode == MANUAL:
                self.mode = MANUAL

    @observe("busy")
    def _on_busy(self, change):
        if self._ready:
            self._update_apply()

    # --- core -------------------------------------------------------------------------------
    def replan(self):
        """Run the chosen planner and fill the rows with its plan; returns the Plan (None on error).

        Examples
        --------
        >>> editor.planner = "memory"     # in auto mode this calls replan()   # doctest: +SKIP
        """
        try:
            p = make_plan(self.model.chain, self.topology, mode=self.planner,
                          objective=self.objective, batch=self.batch, context_len=self.context_len)
        except TfnbError as e:
            self.report(error=f"{self.planner} planner: {one_line(e)}")
            return None
        self._auto_plan = p
        self.report(status=f"{self.planner} planner: {len(p.segments())} segment(s) on "
                            f"{len(p.devices)} device(s), {p.planner_s * 1e3:.3g} ms to plan")
        if p.assignment == self.assignment:
            self._refresh(())
        else:
            self.assignment = p.assignment
        return p

    def set_device(self, stage: str, device: str) -> Plan:
        """Put ``stage`` on ``device`` (full name or short label); switches auto to manual.

        Examples
        --------
        >>> editor.set_device("block.1", "worker:1/CPU:0")          # doctest: +SKIP
        Plan(manual, latency: 2 devices, 2 segments, 0.81 ms/token)
        """
        if stage not in self.assignment:
            raise PlacementError(f"stage {stage!r} is not in {self.model.name!r}: expected one of "
                                 f"{list(self.assignment)[:3]} ... {list(self.assignment)[-1]}")
        device = resolve_device(device, self.topology.devices)
        if self.assignment[stage] != device:
            self.assignment = {**self.assignment, stage: device}
        return self.plan

    def set_range(self, device: str, first=None, last=None) -> Plan:
        """Run stages ``first .. last`` (names or positions) on ``device``; neighbours follow.

        Moving one device's last stage moves the next device's first stage; exactly another
        device's range hands it over (that device drops out); with neither ``first`` nor
        ``last`` the device leaves the pipeline (its stages go to the device before it). A plan
        where a device runs several separate runs is packed first (same number of stages per
        device, devices in order of their first stage), so the result is always contiguous.
        Switches auto to manual. A range that would split another device in two, or take all of
        its stages, raises ``PlacementError`` naming it.

        Examples
        --------
        >>> editor.set_range("worker:1/CPU:0", "block.12", "head")   # doctest: +SKIP
        Plan(manual, latency: 2 devices, 2 segments, 0.81 ms/token)
        >>> editor.set_range("worker:2/CPU:0", "block.20", "head")   # doctest: +SKIP
        Plan(manual, latency: 3 devices, 3 segments, 0.93 ms/token)
        """
        device = resolve_device(device, self.topology.devices)
        before = set(self.assignment.values())
        new = with_range(self.assignment, self.model.chain.names, device, first, last)
        if new != self.assignment:
            self.assignment = new
        gone = sorted(short_device(d) for d in before - set(new.values()) if d != device)
        runs = self.ranges.get(device)
        what = (f"{short_device(device)} runs {format_span_of(runs)}" if runs else
                f"{short_device(device)} runs no stage")
        self.report(status=what + (f"; {', '.join(gone)} now run(s) nothing" if gone else ""))
        return self.plan

    def set_ranges(self, ranges) -> Plan:
        """Place by ranges at once: ``{device: (first, last)}`` or ``[(device, first, last)]``
        covering every stage exactly once (stages by name or position). Switches to manual.

        Examples
        --------
        >>> editor.set_ranges({"worker:0/CPU:0": ("embed", "block.14"),      # doctest: +SKIP
        ...                    "worker:1/CPU:0": ("block.15", "head")})
        Plan(manual, latency: 2 devices, 2 segments, 0.81 ms/token)
        """
        new = from_ranges(self.model.chain.names, ranges)
        try:
            new = {s: resolve_device(d, self.topology.devices) for s, d in new.items()}
        except PlacementError as e:
            raise PlacementError(f"ranges: {e}") from None
        if new != self.assignment:
            self.assignment = new
        return self.plan

    def on_apply(self, callback, remove: bool = False) -> None:
        """Call ``callback(editor)`` after each successful Apply (``remove=True`` unregisters).

        Examples
        --------
        >>> editor.on_apply(lambda ed: print(ed.placed))           # doctest: +SKIP
        >>> editor.apply()                   # or the Apply button  # doctest: +SKIP
        <PlacedLayers net: 4 layers on 2 devices>
        """
        self._apply_callbacks.register_callback(callback, remove=remove)

    def apply(self):
        """Place the model with the current plan, like the Apply button; returns the placed model.

        Uses ``tfnb.place(model, plan, cluster, previous=<last placed>)``. On failure (or while
        Apply is disabled) returns None and :attr:`error` holds the reason in one line.

        Examples
        --------
        >>> editor.on_apply(lambda ed: print(ed.status))           # doctest: +SKIP
        >>> placed = editor.apply()                                # doctest: +SKIP
        """
        if self.apply_disabled_reason:
            self.report(error=f"Apply is disabled: {self.apply_disabled_reason}")
            return None
        plan, previous = self.plan, self.placed
        what = (f"moving {len(self._applied_plan.diff(plan))} stage(s)" if previous is not None
                and self._applied_plan is not None else
                f"placing {len(plan.assignment)} stages on {len(plan.devices)} device(s)")
        self.report(status=f"applying: {what} ...")
        self.set_trait("busy", True)
        start = time.perf_counter()
        try:
            placed = place(self.model, plan, self.cluster, previous=previous, route=self.route)
        except Exception as e:  # noqa: BLE001 - shown in the widget as one line, never a traceback
            self.report(error=f"Apply failed: {one_line(e)}")
            return None
        finally:
            self.set_trait("busy", False)
        self.set_trait("placed", placed)
        self._applied_plan = plan
        routes = getattr(placed, "route_summary", None)  # a llama model's matmul routes
        self.report(status=f"applied in {time.perf_counter() - start:.1f} s: {what}"
                    + (f"; weights: {routes()}" if routes else ""))
        self._refresh(())
        self._apply_callbacks(self)
        return placed

    def export_json(self, path):
        """Write the current plan as JSON (``Plan.save``); returns the path.

        Examples
        --------
        >>> editor.export_json("plan.json")                         # doctest: +SKIP
        PosixPath('plan.json')
        """
        path = self.plan.save(path)
        self.report(status=f"saved the plan to {str(path)!r}")
        return path

    def load(self, source):
        """Show a saved plan (a path, a dict from JSON, or a Plan) in manual mode.

        A plan that does not fit (other stages, unknown devices, over memory, replicated) is
        refused: None is returned and :attr:`error` says why in one line.

        Examples
        --------
        >>> editor.load("plan.json")                                # doctest: +SKIP
        Plan(manual, latency: 2 devices, 2 segments, 0.81 ms/token)
        """
        try:
            p = read_plan(source).validate(self.model.chain, self.topology)
        except (TfnbError, OSError) as e:
            self.report(error=f"plan refused: {one_line(e)}")
            return None
        with self._quiet():
            self.mode, self.objective = MANUAL, p.objective
            self.batch, self.context_len = p.batch, p.context_len
            self.assignment = p.assignment
        self._refresh(None)
        self.report(status=f"loaded a {p.mode} plan ({len(p.segments())} segment(s))")
        return self.plan

    # --- internals ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _quiet(self):
        self._ready = False
        try:
            yield
        finally:
            self._ready = True

    def report(self, status: str = "", error: str = "") -> None:
        """Show one line: ``status``, or ``error`` (which also sets :attr:`error`).

        Examples
        --------
        >>> editor.report(error="plan refused: not JSON")            # doctest: +SKIP
        """
        self.set_trait("error", error)
        self.set_trait("status", error or status)
        cls = "tfnb-status-error" if error else "tfnb-status"
        self.widgets.status.value = f'<span class="{cls}">{html.escape(error or status)}</span>'

    def _current_plan(self) -> Plan:
        auto = self._auto_plan
        if self.mode == AUTO and auto is not None and auto.assignment == self.assignment and \
                (auto.objective, auto.batch, auto.context_len) == \
                (self.objective, self.batch, self.context_len):
            return auto
        pred = predict(self.model.chain, self.assignment, self.topology, self.batch,
                       self.context_len)
        return Plan(dict(self.assignment), MANUAL, self.objective, self.batch, self.context_len,
                    prediction=pred)

    def _refresh(self, changed) -> None:
        """Rebuild the plan and update the views; ``changed`` stages (None: all) get new rows."""
        plan = self._current_plan()
        over = plan.prediction.over_memory()
        self.set_trait("plan", plan)
        self.set_trait("over_memory", over)
        names = self.model.chain.names
        self.set_trait("ranges", {d: [(names[a], names[b]) for a, b in rs] for d, rs in
                                  device_runs(self.assignment, names).items()})
        self.range_rows.show(self.assignment, over)
        self.rows.show(self.assignment, over, changed)
        self.bars.show(plan.prediction)
        w = self.widgets
        w.figures.value = figures_html(plan.prediction, self._applied_plan)
        w.svg.value = plan_svg(plan, self.model.chain, self.topology.devices, over)
        self._export_shown = None
        if w.export.selected_index is not None:
            self._show_export()
        self._update_apply()

    def _show_export(self) -> None:
        """Fill the export views (JSON, Python, download link) with the current plan.

        Only while "Export / load a plan" is open: on 200 stages they are most of the bytes an
        edit would send to the browser.
        """
        plan, w = self.plan, self.widgets
        if plan is None or self._export_shown is plan:
            return
        text = json.dumps(plan.to_dict(), indent=1)
        w.json.value, w.python.value = text, plan.to_python()
        w.download.value = (
            '<a download="plan.json" href="data:application/json;base64,'
            f'{base64.b64encode(text.encode()).decode()}">download plan.json</a>')
        self._export_shown = plan

    def _update_apply(self) -> None:
        reason = apply_blocker(self.busy, self.over_memory)
        self.set_trait("apply_disabled_reason", reason)
        self.widgets.apply.disabled = bool(reason)
        self.widgets.apply.tooltip = reason or "place the model with this plan"
        self.widgets.reason.value = (f'<span class="tfnb-status-error">Apply disabled: '
                                     f"{html.escape(reason)}</span>" if reason else "")

    # --- views ------------------------------------------------------------------------------
    def __str__(self) -> str:
        return editor_text(self)

    def __repr__(self) -> str:
        p = self.plan
        figures = f", {p.prediction.latency_s * 1e3:.3g} ms/token" if p is not None else ""
        return (f"PlacementEditor({self.model.name}: {len(self.assignment)} stages, {self.mode}"
                f"{figures}, apply {'disabled' if self.apply_disabled_reason else 'ready'})")

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = str(self)
        return data
