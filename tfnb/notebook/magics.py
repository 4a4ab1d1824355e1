"""IPython magics (``%load_ext tfnb``): thin wrappers that parse arguments and call one core
function each.

- ``%tfcluster local|connect|status|disconnect|stop``: the cluster this notebook uses;
- ``%%tfprofile``: run the cell under :func:`tfnb.profiler.profile_call` and show the profile;
- ``%tfplace MODEL``: the placement editor for a model on the connected cluster;
- ``%tfserve PLACED``: serve a placed model over OpenAI's HTTP API (:func:`tfnb.serve`).

Loading the extension also turns on live text for generate calls and shows matplotlib Figures
inline. Bad arguments raise :class:`IPython.core.error.UsageError` (IPython shows one line, no
traceback) before any state changes; errors tfnb raises on purpose are shown the same way.
"""
from __future__ import annotations

import ast
import shlex
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

import tfnb.cluster as core
from tfnb.errors import TfnbError
from tfnb.names import AUTO, EDITOR_MODES, OBJECTIVES, PIPELINE_PLANNERS
from tfnb.notebook.stream import enable
from tfnb.profiler import profile_call


def options(*arguments):
    """One decorator applying several ``magic_arguments.argument`` decorators in order: a bundle
    of options that several magics or actions share (as ipyparallel's magics do)."""
    def apply(func):
        for arg in reversed(arguments):
            func = arg(func)
        return func
    return apply


output_option = options(
    argument("-o", "--output", default=None, help="store the result object in this variable"))
timeout_option = options(
    argument("--timeout", type=float, default=None,
             help="seconds each worker has to answer (default: the function's)"))


# One argument spec per %tfcluster action, each flag a keyword of the function the action calls.
@magic_arguments("tfcluster local")
@argument("n_workers", nargs="?", default=None, help="number of workers (1-64)")
@argument("--start-timeout", type=float, default=None, help="seconds each worker has to start")
@argument("--isolate", action="store_true",
          help="keep the workers unreachable from other hosts (Linux, root, nftables)")
@timeout_option
@output_option
def _local():
    """``%tfcluster local N``: start N TF workers on this machine and connect (``tfnb.local``)."""


@magic_arguments("tfcluster connect")
@argument("spec", nargs="?", default=None, help="'host:port,host:port' or a JSON cluster spec")
@argument("--file", default=None, help="a JSON cluster file (instead of SPEC)")
@argument("--tf-config", action="store_true", help="read the cluster from TF_CONFIG")
@argument("--advertise", default=None, help="host the workers use to reach this client")
@timeout_option
@output_option
def _connect():
    """``%tfcluster connect SPEC``: reach running workers and connect (``tfnb.connect``)."""


@magic_arguments("tfcluster status")
@timeout_option
@output_option
def _status():
    """``%tfcluster status``: state, latency, devices and memory per worker
    (``Cluster.status``)."""


@magic_arguments("tfcluster disconnect")
@output_option
def _disconnect():
    """``%tfcluster disconnect``: forget the cluster, workers keep running
    (``Cluster.disconnect``)."""


@magic_arguments("tfcluster stop")
@output_option
def _stop():
    """``%tfcluster stop``: disconnect and stop the workers tfnb started (``Cluster.stop``)."""


ACTIONS = {"local": _local, "connect": _connect, "status": _status, "disconnect": _disconnect,
           "stop": _stop}


def _split(line: str, prefix: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as e:  # unbalanced quotes
        raise UsageError(f"{prefix}: cannot parse {line!r}: {e}") from None


def _check_output(output: str | None, prefix: str) -> None:
    if output is not None and not output.isidentifier():
        raise UsageError(f"{prefix}: -o {output!r} is not a valid variable name")


def _parse_line(magic, line: str, prefix: str):
    """Parse ``line`` with ``magic``'s argument spec; every failure is one UsageError."""
    _split(line, prefix)
    try:
        args = parse_argstring(magic, line)
    except ValueError as e:  # unbalanced quotes in IPython's own splitting
        raise UsageError(f"{prefix}: cannot parse {line!r}: {e}") from None
    _check_output(getattr(args, "output", None), prefix)
    return args


def _n_workers(n: str | None) -> int:
    """The worker count: the one value the pure parse checks itself, since it turns the word
    into an int (tfnb.local checks the same range again, before it stops anything)."""
    if n is None or not n.isdigit() or not 1 <= int(n) <= 64:
        raise UsageError(f"%tfcluster local: number of workers {n!r}; expected an integer from 1 "
                         "to 64")
    return int(n)


def parse_tfcluster(line: str) -> tuple[str, dict, str | None]:
    """Parse a ``%tfcluster`` line into (action, keyword arguments of its function, output name).

    Raises UsageError naming the bad word; the values' ranges are the called function's to check.
    Pure: touches no cluster.

    Examples
    --------
    >>> parse_tfcluster("connect a:1,b:2 --timeout 3 -o c")
    ('connect', {'spec': 'a:1,b:2', 'timeout': 3.0}, 'c')
    """
    words = _split(line, "%tfcluster")
    action = words[0] if words else None
    if action not in ACTIONS:
        what = "no action" if action is None else f"unknown action {action!r}"
        raise UsageError(f"%tfcluster: {what}; expected one of {', '.join(ACTIONS)}")
    spec, prefix = ACTIONS[action], f"%tfcluster {action}"
    try:
        args, extra = spec.parser.parse_known_args(words[1:])
    except UsageError as e:  # argparse's own message: a bad value or a missing one
        raise UsageError(f"{prefix}: {e}") from None
    if extra:
        raise UsageError(f"{prefix}: unexpected {extra[0]!r}; usage: "
                         f"{' '.join(spec.parser.format_usage().split()[1:])}")
    _check_output(args.output, prefix)
    kw = {k: v for k, v in vars(args).items() if k != "output" and v not in (None, False)}
    if action == "local":
        kw["n_workers"] = _n_workers(args.n_workers)
    elif action == "connect":
        sources = [s for s in (args.spec, args.file, args.tf_config or None) if s is not None]
        if len(sources) != 1:
            raise UsageError(f"{prefix}: give exactly one of SPEC, --file FILE or --tf-config "
                             f"(got {len(sources)})")
        if args.file is not None:
            kw["spec"] = Path(kw.pop("file"))
    return action, kw, args.output


def parse_tfprofile(line: str, cell: str | None) -> tuple[dict, str | None]:
    """Parse a ``%%tfprofile`` line into (keyword arguments of ``profile_call``, output name).

    Raises UsageError naming the bad word; ``profile_call`` checks the values. Pure: touches no
    cluster.
    """
    args = _parse_line(TfnbMagics.tfprofile, line, "%%tfprofile")
    if cell is None or not cell.strip():
        raise UsageError("%%tfprofile: the cell is empty; put the code to profile on the lines "
                         "below %%tfprofile")
    return {"timeout": args.timeout, "trace_dir": args.trace_dir}, args.output


def parse_tfplace(line: str) -> tuple[str, dict, str | None]:
    """Parse a ``%tfplace`` line into (model variable name, editor keywords, output name).

    Raises UsageError naming the bad value. Pure: reads no namespace, touches no cluster.
    """
    args = _parse_line(TfnbMagics.tfplace, line, "%tfplace")
    if not args.model.isidentifier():
        raise UsageError(f"%tfplace: {args.model!r} is not a variable name; expected the name of a "
                         "model, e.g. %tfplace model after model = tfnb.load_model('smollm2')")
    kw = {"mode": args.mode, "objective": args.objective}
    if args.planner is not None:
        kw["planner"] = args.planner
    if args.route is not None:
        kw["route"] = args.route
    return args.model, kw, args.output


def _run_action(action: str, kw: dict):
    if action == "local":
        return core.local(**kw)
    if action == "connect":
        return core.connect(**kw)
    cluster = core.current()
    return cluster.status(**kw) if action == "status" else getattr(cluster, action)()


def _tfcluster_doc(doc: str) -> str:
    """The magic's docstring followed by each action's generated help."""
    return doc + "\n".join(f"\n{name}\n{'-' * len(name)}\n{ACTIONS[name].__doc__}"
                           for name in ACTIONS)


@magics_class
class TfnbMagics(Magics):
    """``%tfcluster``, ``%%tfprofile``, ``%tfplace`` and ``%tfserve``."""

    @line_magic
    def tfcluster(self, line: str = ""):
        """Start, reach, inspect or stop the TF cluster this notebook uses.

        ``%tfcluster ACTION [options]``, ACTION one of local, connect, status, disconnect, stop;
        each action's options are the keywords of the function it calls (below).

        Examples
        --------
        ::

          %tfcluster local 2
          %tfcluster connect host1:2222,host2:2222 --timeout 5
          %tfcluster connect --file cluster.json
          %tfcluster status -o st
          %tfcluster stop
        """
        action, kw, output = parse_tfcluster(line)
        try:
            result = _run_action(action, kw)
        except TfnbError as e:
            raise UsageError(f"%tfcluster {action}: {e}") from None
        if output:
            self.shell.user_ns[output] = result
        return result

    tfcluster.__doc__ = _tfcluster_doc(tfcluster.__doc__)

    @magic_arguments()
    @argument("-o", "--output", default=None, help="store the Profile in this variable")
    @argument("--trace-dir", default=None,
              help="also write the raw traces there, in TensorBoard's plugins/profile layout")
    @argument("--timeout", type=float, default=60.0,
              help="most seconds to wait for any worker to start or return its trace (default 60)")
    @cell_magic
    def tfprofile(self, line: str = "", cell: str | None = None):
        """Run the cell while tracing every worker of the connected cluster and this process.

        Shows a :class:`tfnb.profiler.Profile` (busy time per device, transfers, timeline). The
        cell's own exceptions propagate as usual; the capture is stopped either way (and with
        ``-o`` the profile of the failed run is stored too).

        Examples
        --------
        ::

          %%tfprofile -o prof --timeout 30
          out = placed.generate("Hello", max_new_tokens=8)
        """
        kw, output = parse_tfprofile(line, cell)
        code = compile(ast.parse(self.shell.transform_cell(cell)), "<%%tfprofile cell>", "exec")
        started = []

        def run_cell():
            started.append(True)
            exec(code, self.shell.user_ns)  # noqa: S102 - the user's own cell, as %%time does

        try:
            result = profile_call(run_cell, **kw)
        except TfnbError as e:
            if not started:  # ours (e.g. not connected, a bad --timeout), not the cell's
                raise UsageError(f"%%tfprofile: {e}") from None
            self._store(output, e)
            raise
        except BaseException as e:
            self._store(output, e)
            raise
        if output:
            self.shell.user_ns[output] = result
        return result

    @magic_arguments()
    @argument("model", help="name of the variable holding the model (never evaluated)")
    @argument("--mode", choices=EDITOR_MODES, default=AUTO,
              help="auto: a planner fills the rows (default); manual: start from them and edit")
    @argument("--planner", choices=PIPELINE_PLANNERS, default=None,
              help="the planner of auto mode (default optimal)")
    @argument("--objective", choices=OBJECTIVES, default="latency",
              help="what the planner minimises (default latency)")
    @argument("--route", choices=("auto", "kernel", "xla"), default=None,
              help="how packed matrices multiply: tfnb's kernel, plain XLA ops, or auto "
                   "(default: the kernel where a CPU device has it)")
    @argument("-o", "--output", default=None, help="store the editor in this variable")
    @line_magic
    def tfplace(self, line: str = ""):
        """Open the placement editor for a model on the connected cluster.

        Shows a :class:`tfnb.notebook.widgets.PlacementEditor`: a planner's plan (or your own,
        row by row), predicted latency, throughput and bytes per token, memory per device, a
        dataflow picture, and Apply, which places the model (``editor.placed``).

        Examples
        --------
        ::

          %tfcluster local 2
          model = tfnb.load_model("smollm2")
          %tfplace model --objective throughput -o editor
          editor.apply()
        """
        name, kw, output = parse_tfplace(line)
        if name not in self.shell.user_ns:
            raise UsageError(f"%tfplace: no variable {name!r} in this notebook; expected the name "
                             "of a model, e.g. model = tfnb.load_model('smollm2')")
        # here, not at the top: %load_ext tfnb does not import ipywidgets
        from tfnb.notebook.widgets import PlacementEditor

        try:
            editor = PlacementEditor(self.shell.user_ns[name], **kw)
        except TfnbError as e:
            raise UsageError(f"%tfplace: {e}") from None
        if output:
            self.shell.user_ns[output] = editor
        return editor

    @magic_arguments()
    @argument("placed", help="name of the variable holding the placed model (never evaluated)")
    @argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    @argument("--port", type=int, default=0, help="port (default 0: any free port)")
    @argument("--api-key", default=None, help="bearer token every request must send "
                                              "(needed beyond loopback)")
    @argument("--model", default=None, help="the model name clients ask for")
    @argument("--no-warmup", action="store_true",
              help="do not compile the request shapes ahead in the background")
    @argument("--view", action="store_true",
              help="also show a live view of the requests it serves (tfnb.serving_view(server))")
    @argument("-o", "--output", default=None, help="store the server in this variable")
    @line_magic
    def tfserve(self, line: str = ""):
        """Serve a placed model over OpenAI's HTTP API from this kernel (``tfnb.serve``).

        Examples
        --------
        ::

          placed = tfnb.place(model, tfnb.plan(model, cluster, mode="replicate"), cluster)
          %tfserve placed -o server
          # any OpenAI client: OpenAI(base_url=server.url, api_key="none")
          %tfserve placed --view -o server   # and watch its requests, slots and tokens/s live
          server.close()
        """
        args = _parse_line(TfnbMagics.tfserve, line, "%tfserve")
        if not args.placed.isidentifier() or args.placed not in self.shell.user_ns:
            raise UsageError(f"%tfserve: no variable {args.placed!r} in this notebook; expected "
                             "the name of a placed model, e.g. placed = tfnb.place(model, plan)")
        from tfnb.serving import serve  # here: %load_ext tfnb does not import the HTTP stack

        try:
            server = serve(self.shell.user_ns[args.placed], host=args.host, port=args.port,
                           api_key=args.api_key, model=args.model,
                           warmup=not args.no_warmup)
        except TfnbError as e:
            raise UsageError(f"%tfserve: {e}") from None
        if args.output:
            self.shell.user_ns[args.output] = server
        if args.view:
            from tfnb.notebook.widgets.serving_view import serving_view  # imports ipywidgets

            display(serving_view(server))  # the view's thread redraws it; the cell ends at once
        return server

    def _store(self, output: str | None, exc: BaseException) -> None:
        prof = getattr(exc, "tfnb_profile", None)
        if output and prof is not None:
            self.shell.user_ns[output] = prof


def show_figures_inline(ipython) -> bool:
    """Show matplotlib Figures (``prof.plot(...)``) as PNG images in notebook outputs.

    tfnb draws its figures without pyplot, so IPython's inline backend, which is set up only
    when pyplot is imported, never registers a PNG formatter for them and a returned Figure
    prints as ``<Figure size 700x380 with 1 Axes>``. Registers one by name (matplotlib is not
    imported) unless a formatter for Figures is already set (``%matplotlib inline``, the user's).
    Returns whether it registered one.
    """
    png = ipython.display_formatter.formatters.get("image/png")
    if png is None:
        return False
    try:
        png.lookup_by_type("matplotlib.figure.Figure")
        return False
    except KeyError:
        pass

    def figure_png(fig):
        from IPython.core.pylabtools import print_figure

        return print_figure(fig, "png", bbox_inches="tight")

    png.for_type_by_name("matplotlib.figure", "Figure", figure_png)
    return True


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(TfnbMagics)
    enable(ipython)  # live text for generate calls, in Jupyter kernels only
    show_figures_inline(ipython)
