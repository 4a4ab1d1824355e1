"""The serving view: what a placed model is serving, redrawn live while the kernel stays free.

:class:`ServingView` shows ``model.serving_status()``
(:meth:`tfnb.runtime.PlacedModel.serving_status`) as HTML: per replica, one row per lane with a
bar of its cache rows in use, and one row per request in flight (tokens so far, tokens/s, queue
wait, time to first token); below, the requests that finished last. A daemon thread redraws it
every ``interval`` seconds, so cells keep running meanwhile; it holds the model weakly and ends
with ``stop()``/``close()``, when the model is garbage-collected, or when the widget is closed.
:func:`serving_html` is the drawing alone, a pure function of a status.

Outside a Jupyter kernel (terminal IPython, scripts) :func:`serving_view` gives
:class:`ServingText` instead: the same thread and ``stop()``, printing :func:`serving_text` (per
replica and lane: rows in use, requests in flight) whenever the status changed.

Examples
--------
>>> view = tfnb.serving_view(placed)          # doctest: +SKIP
>>> view                                      # doctest: +SKIP
>>> server = tfnb.serve(placed); tfnb.serving_view(server)  # doctest: +SKIP
>>> view.stop()                               # doctest: +SKIP
"""
from __future__ import annotations

import html
import math
import sys
import threading
import weakref

import ipywidgets as W
from traitlets import Bool, Dict, Float, TraitError, validate

from tfnb.errors import TfnbError
from tfnb.names import short_device

__all__ = ["ServingView", "ServingText", "serving_view", "serving_html", "serving_text",
           "ServingViewError"]

RECENT_SHOWN = 8  # finished requests drawn, newest first

_STYLE = ("<style>.tfnb-serving td,.tfnb-serving th{padding:1px 8px;text-align:right}"
          ".tfnb-serving th{font-weight:600}.tfnb-serving td:first-child{text-align:left}"
          ".tfnb-bar{display:inline-block;width:120px;height:10px;background:#eee;"
          "vertical-align:middle}.tfnb-bar>span{display:block;height:10px;background:#4a8}"
          "</style>")


class ServingViewError(TfnbError, ValueError):
    """A bad argument to ``ServingView``: not a placed model, or a bad interval."""


def _model_of(model):
    """The object whose ``serving_status()`` the view reads; ServingViewError otherwise."""
    from tfnb.runtime import PlacedModel, ReplicatedModel
    from tfnb.serving import Server

    if isinstance(model, Server):
        model = model.placed
    if not isinstance(model, (PlacedModel, ReplicatedModel)):
        raise ServingViewError(f"model={model!r:.80}: expected a placed model (the result of "
                               "tfnb.place: a PlacedModel or ReplicatedModel) or the Server "
                               "tfnb.serve returned")
    return model


def _check_interval(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ServingViewError(f"interval={value!r}: expected seconds between refreshes, a "
                               "number > 0 such as 0.5")
    return float(value)


# ----- drawing -------------------------------------------------------------------------------

def _s(x) -> str:
    return "" if x is None else f"{x * 1000:.0f} ms" if x < 1 else f"{x:.1f} s"


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='tfnb-serving'><tr>{th}</tr>{body}</table>"


def _bar(used: int, total: int) -> str:
    width = 0 if total <= 0 else round(100 * min(used, total) / total)
    return (f"<span class='tfnb-bar' title='{used} of {total} rows'><span "
            f"style='width:{width}%'></span></span> {used}/{total}")


def _request_row(r: dict, replica: bool = False) -> list[str]:
    prompts = "+".join(str(n) for n in r["prompt_tokens"])
    cells = [f"#{r['id']}"] + ([str(r["replica"])] if replica else []) + [
        str(r["lane"]), html.escape(r["state"]), prompts, f"{r['tokens']}/{r['max_tokens']}",
        _s(r["age_s"]), _s(r["queue_s"]), _s(r["first_token_s"]), f"{r['tokens_per_s']:.1f}"]
    return cells


_REQUEST_HEAD = ["request", "lane", "state", "prompt tokens", "tokens", "age", "queue",
                 "first token", "tokens/s"]


def serving_html(status: dict) -> str:
    """A serving status (``model.serving_status()``) as HTML: one section per replica (its
    lanes with a bar of rows in use, its requests in flight), then the last finished requests.
    Pure: does no I/O.

    Examples
    --------
    >>> st = {"model": "tiny", "in_flight": 0, "requests": [], "recent": [], "replicas": [
    ...     {"replica": 0, "devices": ["/job:worker/replica:0/task:0/device:CPU:0"],
    ...      "lost": None, "requests": [], "lanes": [{"lane": 0, "rows": 8, "rows_in_use": 3,
    ...      "waiting": 1, "waiting_rows": 1, "slot": 40, "slots": 256, "steps": 9}]}]}
    >>> "3/8" in serving_html(st) and "worker:0/CPU:0" in serving_html(st)
    True
    """
    parts = [_STYLE, f"<b>{html.escape(str(status.get('model') or 'model'))}</b>: "
             f"{status['in_flight']} request(s) in flight on {len(status['replicas'])} "
             "replica(s)"]
    for rep in status["replicas"]:
        where = ", ".join(short_device(d) for d in rep["devices"])
        title = f"replica {rep['replica']} on {html.escape(where)}"
        if rep.get("lost") or rep.get("state", "serving") != "serving":
            why = f": {rep['lost']}" if rep.get("lost") else ""
            title += (f" <span style='color:#c00'>{html.escape(rep.get('state', 'lost'))}"
                      f"{html.escape(why)}</span>")
        lanes = _table(["lane", "rows in use", "waiting", "slot", "steps"], [
            [str(ln["lane"]), _bar(ln["rows_in_use"], ln["rows"]),
             f"{ln['waiting']} ({ln['waiting_rows']} rows)" if ln["waiting"] else "0",
             f"{ln['slot']}/{ln['slots']}", str(ln["steps"])] for ln in rep["lanes"]])
        requests = (_table(_REQUEST_HEAD, [_request_row(r) for r in rep["requests"]])
                    if rep["requests"] else "<i>no requests in flight</i>")
        parts.append(f"<div class='tfnb-replica'><h4 style='margin:6px 0 2px'>{title}</h4>"
                     f"{lanes}{requests}</div>")
    recent = status["recent"][::-1][:RECENT_SHOWN]
    if recent:
        head = ["request", "replica"] + _REQUEST_HEAD[1:]
        head[3] = "outcome"
        parts.append(f"<h4 style='margin:6px 0 2px'>finished last ({len(recent)} of "
                     f"{len(status['recent'])} kept)</h4>"
                     + _table(head, [_request_row(r, replica=True) for r in recent]))
    return "<div>" + "".join(parts) + "</div>"


# ----- text ----------------------------------------------------------------------------------

def _ids(requests: list[dict], shown: int = 6) -> str:
    ids = [f"#{r['id']} {r['tokens']}/{r['max_tokens']}" for r in requests[:shown]]
    more = len(requests) - shown
    return ", ".join(ids) + (f", +{more} more" if more > 0 else "")


def serving_text(status: dict) -> str:
    """A serving status as compact text, for terminals and logs: a headline, then per replica
    and lane the cache rows in use and the requests in flight (id, tokens so far/asked).
    Pure: does no I/O.

    Examples
    --------
    >>> st = {"model": "tiny", "in_flight": 1, "recent": [], "requests": [], "replicas": [
    ...     {"replica": 0, "devices": ["/job:worker/replica:0/task:0/device:CPU:0"],
    ...      "lost": None, "requests": [{"id": 7, "lane": 0, "tokens": 5, "max_tokens": 96}],
    ...      "lanes": [{"lane": 0, "rows": 8, "rows_in_use": 1, "waiting": 0,
    ...                 "waiting_rows": 0, "slot": 40, "slots": 256, "steps": 9}]}]}
    >>> print(serving_text(st))
    tiny: 1 request(s) in flight on 1 replica(s)
      replica 0 on worker:0/CPU:0
        lane 0: 1/8 rows in use, 1 in flight: #7 5/96
    """
    lines = [f"{status.get('model') or 'model'}: {status['in_flight']} request(s) in flight "
             f"on {len(status['replicas'])} replica(s)"]
    for rep in status["replicas"]:
        where = ", ".join(short_device(d) for d in rep["devices"])
        state = rep.get("state", "lost" if rep.get("lost") else "serving")
        lost = (f" ({state}: {rep['lost']})" if rep.get("lost")
                else f" ({state})" if state != "serving" else "")
        lines.append(f"  replica {rep['replica']} on {where}{lost}")
        for ln in rep["lanes"]:
            running = [r for r in rep["requests"] if r["lane"] == ln["lane"]]
            waiting = f", {ln['waiting']} waiting" if ln["waiting"] else ""
            flight = f"{len(running)} in flight" + (f": {_ids(running)}" if running else "")
            lines.append(f"    lane {ln['lane']}: {ln['rows_in_use']}/{ln['rows']} rows in use, "
                         f"{flight}{waiting}")
    return "\n".join(lines)


# ----- the live views ------------------------------------------------------------------------

class _Live:
    """What both live views share: the model held weakly, a daemon thread calling
    :meth:`refresh` every ``interval`` s, ``on_refresh`` callbacks and ``stop``. A view draws
    with ``_draw(status)``, ``_draw_note(text)`` and says it ended with ``_set_running``."""

    def _start(self, target) -> None:
        self._model = weakref.ref(target)
        self._callbacks: list = []
        self._lock = threading.Lock()  # one refresh at a time (the thread's or a caller's)
        self.refresh()
        self._thread = threading.Thread(target=_refresh_loop,
                                        args=(weakref.ref(self), self._stop),
                                        name="tfnb-serving-view", daemon=True)
        self._set_running(True)
        self._thread.start()

    @property
    def model(self):
        """The model shown, or None once it was garbage-collected."""
        return self._model()

    @property
    def thread(self) -> threading.Thread:
        """The refresh thread."""
        return self._thread

    @property
    def _closed(self) -> bool:
        return False

    def on_refresh(self, callback, remove: bool = False) -> None:
        """Call ``callback(view)`` after every refresh (or stop calling it, ``remove=True``).

        Examples
        --------
        >>> view.on_refresh(lambda v: print(len(v.status["requests"])))  # doctest: +SKIP
        """
        if remove:
            self._callbacks.remove(callback)
        else:
            self._callbacks.append(callback)

    def refresh(self) -> bool:
        """Read the model's status once and redraw; what the thread does every ``interval``.
        Returns False (and the view says so) once the model is gone.

        Examples
        --------
        >>> view.refresh()                                 # doctest: +SKIP
        True
        """
        with self._lock:
            model = self._model()
            if model is None:
                self._draw_note("the model of this view is gone (garbage-collected)")
                return False
            try:
                status = model.serving_status()
            except Exception as e:  # noqa: BLE001 - the view says it and tries again
                self._draw_note(f"cannot read the serving status: {type(e).__name__}: {e}")
                return True
            finally:
                del model
            self._draw(status)
            self.status = status
        for callback in list(self._callbacks):
            callback(self)
        return True

    def stop(self, timeout: float = 5.0, _current=threading.current_thread) -> None:
        """End the refresh thread (within ``timeout`` s); the last drawing stays."""
        # (``_current`` bound here: ipywidgets closes widgets from __del__, also at exit)
        thread = getattr(self, "_thread", None)
        if thread is None:  # a construction that failed: no thread was made
            return
        self._stop.set()
        if thread is not _current() and thread.is_alive():
            thread.join(timeout)
        self._set_running(thread.is_alive())

    def _describe(self) -> str:
        model = self._model()
        what = "gone" if model is None else repr(model)
        return f"of {what}, every {self.interval} s, {'running' if self.running else 'stopped'}"


class ServingView(_Live, W.VBox):
    """A live view of what ``model`` serves, redrawn every ``interval`` s by a daemon thread.

    The widget, for Jupyter; :func:`serving_view` gives :class:`ServingText` outside a kernel.

    Parameters
    ----------
    model : PlacedModel, ReplicatedModel or Server
        The result of ``tfnb.place`` (held weakly: the view never keeps a model alive), or the
        ``Server`` from ``tfnb.serve`` (the model it serves).
    interval : float
        Seconds between refreshes, > 0.

    Examples
    --------
    >>> view = ServingView(placed, interval=0.5)        # doctest: +SKIP
    >>> view.on_refresh(lambda v: print(v.status["in_flight"]))  # doctest: +SKIP
    >>> view.refresh()                                  # doctest: +SKIP
    0
    >>> view.stop()                                     # doctest: +SKIP
    """

    interval = Float(0.5, help="seconds between two refreshes (> 0)")
    running = Bool(False, read_only=True, help="whether the refresh thread is running")
    status = Dict(help="the serving status last drawn (model.serving_status()); empty before "
                       "the first refresh")

    def __init__(self, model, interval: float = 0.5, **kwargs):
        target, interval = _model_of(model), _check_interval(interval)  # before any widget
        self._stop = threading.Event()
        super().__init__(**kwargs)
        self.interval = interval
        self.html = W.HTML()
        self.children = [self.html]
        self._start(target)

    @validate("interval")
    def _valid_interval(self, proposal):
        try:
            return _check_interval(proposal["value"])
        except ServingViewError as e:
            raise TraitError(str(e)) from None

    @property
    def _closed(self) -> bool:
        return self.comm is None

    def _set_running(self, running: bool) -> None:
        self.set_trait("running", running)

    def _draw(self, status: dict) -> None:
        drawn = serving_html(status)
        if drawn != self.html.value:
            self.html.value = drawn

    def _draw_note(self, text: str) -> None:
        red = "" if "gone" in text else " style='color:#c00'"
        self.html.value = f"<i{red}>{html.escape(text)}</i>"

    def close(self) -> None:
        """Stop the refresh thread and close the widget."""
        self.stop()
        super().close()

    def __repr__(self) -> str:
        return f"<ServingView {self._describe()}>"


class ServingText(_Live):
    """The serving view as text, for terminal IPython and scripts: prints
    :func:`serving_text` of the status at the start and at every refresh that changed it (an
    idle model prints nothing more); ``text`` is the last one printed, also ``str(view)``.

    Parameters
    ----------
    model : PlacedModel, ReplicatedModel or Server
        As for :class:`ServingView` (held weakly).
    interval : float
        Seconds between refreshes, > 0.
    file : file-like, optional
        Where to print (default: ``sys.stdout`` at each print).

    Examples
    --------
    >>> view = ServingText(placed, interval=2.0)      # doctest: +SKIP
    tiny: 0 request(s) in flight on 1 replica(s)
      replica 0 on worker:0/CPU:0
        lane 0: 0/8 rows in use, 0 in flight
    >>> view.stop()                                   # doctest: +SKIP
    """

    def __init__(self, model, interval: float = 0.5, file=None):
        target, self.interval = _model_of(model), _check_interval(interval)
        self._stop = threading.Event()
        self.file, self.text, self.status, self.running = file, "", {}, False
        self._start(target)

    def _set_running(self, running: bool) -> None:
        self.running = running

    def _draw(self, status: dict) -> None:
        self._draw_note(serving_text(status))

    def _draw_note(self, text: str) -> None:
        if text != self.text:
            self.text = text
            print(text, file=self.file or sys.stdout, flush=True)

    def close(self) -> None:
        """The same as :meth:`stop`, as the widget has it."""
        self.stop()

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"<ServingText {self._describe()}>"


def _refresh_loop(ref: weakref.ref[_Live], stop: threading.Event) -> None:
    """The refresh thread: holds the view only while it redraws it, so a dropped view ends it
    too; ends when stopped, when the model is gone, or when the widget was closed."""
    while True:
        view = ref()
        if view is None:
            return
        interval = view.interval
        del view
        if stop.wait(interval):
            break
        view = ref()
        if view is None or view._closed:  # dropped, or closed
            return
        try:
            alive = view.refresh()
        except Exception:  # noqa: BLE001 - a callback failed; the view goes on
            alive = True
        if not alive:
            view._set_running(False)
            return
        del view
    view = ref()
    if view is not None:
        view._set_running(False)


def serving_view(model, interval: float = 0.5):
    """A live view of ``model`` (a placed or replicated model, or a Server): the
    :class:`ServingView` widget in a Jupyter kernel, :class:`ServingText` elsewhere (terminal
    IPython, scripts), which prints the status when it changes. Both end with ``stop()``.

    Examples
    --------
    >>> view = tfnb.serving_view(placed)           # doctest: +SKIP
    >>> view.stop()                                # doctest: +SKIP
    """
    from tfnb.notebook import in_kernel

    if in_kernel():
        return ServingView(model, interval=interval)
    return ServingText(model, interval=interval)
