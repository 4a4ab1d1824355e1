"""IPython magics: thin wrappers that parse arguments and call one core function each.

Bad arguments raise :class:`IPython.core.error.UsageError` (IPython shows one line, no traceback)
before any state changes; errors tfnb raises on purpose are shown the same way.
"""
from __future__ import annotations

import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from tfnb.errors import TfnbError

_ACTIONS = ("local", "connect", "status", "disconnect", "stop")


def _flags_for(action: str) -> set[str]:
    return {"local": {"timeout", "isolate", "output"},
            "connect": {"timeout", "tf_config", "file", "advertise", "output"},
            "status": {"timeout", "output"}}.get(action, set())


def _parse_line(magic, line: str, prefix: str):
    """Parse ``line`` with ``magic``'s argument spec; every failure is one UsageError."""
    try:
        shlex.split(line)
        args = parse_argstring(magic, line)
    except ValueError as e:  # unbalanced quotes, in shlex's or IPython's own splitting
        raise UsageError(f"{prefix}: cannot parse {line!r}: {e}") from None
    output = getattr(args, "output", None)
    if output is not None and not output.isidentifier():
        raise UsageError(f"{prefix}: -o {output!r} is not a valid variable name")
    return args


def parse_tfcluster(line: str) -> tuple[str, dict, str | None]:
    """Parse a ``%tfcluster`` line into (action, keyword arguments of its function, output name).

    Raises UsageError naming the bad value. Pure: touches no cluster.
    """
    args = _parse_line(TfnbMagics.tfcluster, line, "%tfcluster")
    action = args.action
    if action not in _ACTIONS:
        raise UsageError(f"%tfcluster: unknown action {action!r}; expected one of {', '.join(_ACTIONS)}")
    given = {k for k, v in vars(args).items() if k not in ("action", "target") and v not in (None, False)}
    extra = given - _flags_for(action)
    if extra:
        flag = sorted(extra)[0].replace("_", "-")
        raise UsageError(f"%tfcluster {action}: option --{flag} does not apply; "
                         f"it takes {', '.join('--' + f.replace('_', '-') for f in sorted(_flags_for(action))) or 'no options'}")
    if args.timeout is not None and not 0 < args.timeout <= 3600:
        raise UsageError(f"%tfcluster: --timeout {args.timeout:g}; expected seconds, > 0 and <= 3600")
    kw: dict = {}
    if args.timeout is not None:
        kw["start_timeout" if action == "local" else "timeout"] = args.timeout
    if action == "local":
        n = args.target
        if n is None or not n.isdigit() or not 1 <= int(n) <= 64:
            raise UsageError(f"%tfcluster local: number of workers {n!r}; expected an integer from 1 to 64")
        kw.update(n_workers=int(n), isolate=args.isolate)
    elif action == "connect":
        sources = [s for s in (args.target, args.file, args.tf_config or None) if s is not None]
        if len(sources) != 1:
            raise UsageError("%tfcluster connect: give exactly one of SPEC, --file FILE or --tf-config "
                             f"(got {len(sources)})")
        if args.file is not None:
            from pathlib import Path
            kw["spec"] = Path(args.file)
        elif args.tf_config:
            kw["tf_config"] = True
        else:
            kw["spec"] = args.target
        if args.advertise is not None:
            kw["advertise"] = args.advertise
    elif args.target is not None:
        raise UsageError(f"%tfcluster {action}: unexpected argument {args.target!r}")
    return action, kw, args.output


def parse_tfprofile(line: str, cell: str | None) -> tuple[dict, str | None]:
    """Parse a ``%%tfprofile`` line into (keyword arguments of ``profile_call``, output name).

    Raises UsageError naming the bad value. Pure: touches no cluster.
    """
    args = _parse_line(TfnbMagics.tfprofile, line, "%%tfprofile")
    if not 0 < args.timeout <= 3600:
        raise UsageError(f"%%tfprofile: --timeout {args.timeout:g}; expected seconds, > 0 and <= 3600")
    if args.trace_dir is not None and not args.trace_dir.strip():
        raise UsageError(f"%%tfprofile: --trace-dir {args.trace_dir!r}; expected a directory path")
    if cell is None or not cell.strip():
        raise UsageError("%%tfprofile: the cell is empty; put the code to profile on the lines below %%tfprofile")
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
    return args.model, kw, args.output


@magics_class
class TfnbMagics(Magics):
    """``%tfcluster``, ``%%tfprofile`` and ``%tfplace``."""

    @magic_arguments()
    @argument("action", help="one of: " + ", ".join(_ACTIONS))
    @argument("target", nargs="?", default=None,
              help="local: number of workers (1-64); connect: 'host:port,host:port' or a JSON file")
    @argument("--timeout", type=float, default=None,
              help="seconds each worker has to answer (connect, status) or to start (local)")
    @argument("--tf-config", action="store_true", help="connect: read the cluster from TF_CONFIG")
    @argument("--file", default=None, help="connect: a JSON cluster file")
    @argument("--advertise", default=None, help="connect: host the workers use to reach this client")
    @argument("--isolate", action="store_true",
              help="local: keep the workers unreachable from other hosts (Linux, root, nftables)")
    @argument("-o", "--output", default=None, help="store the result object in this variable")
    @line_magic
    def tfcluster(self, line: str = ""):
        """Start, reach, inspect or stop the TF cluster this notebook uses.

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
        import tfnb.cluster as core

        try:
            if action == "local":
                result = core.local(**kw)
            elif action == "connect":
                result = core.connect(**kw)
            elif action == "status":
                result = core.current().status(**kw)
            elif action == "disconnect":
                result = core.current().disconnect()
            else:
                result = core.current().stop()
        except TfnbError as e:
            raise UsageError(str(e)) from None
        if output:
            self.shell.user_ns[output] = result
        return result


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
        import ast

        from tfnb.profiler import profile_call

        code = compile(ast.parse(self.shell.transform_cell(cell)), "<%%tfprofile cell>", "exec")
        started = []

        def run_cell():
            started.append(True)
            exec(code, self.shell.user_ns)  # noqa: S102 - the user's own cell, as %%time does

        try:
            result = profile_call(run_cell, **kw)
        except TfnbError as e:
            if not started:  # ours (e.g. not connected), not the cell's
                raise UsageError(str(e)) from None
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
    @argument("--mode", choices=("auto", "manual"), default="auto",
              help="auto: a planner fills the rows (default); manual: start from them and edit")
    @argument("--planner", choices=("optimal", "greedy", "memory"), default=None,
              help="the planner of auto mode (default optimal)")
    @argument("--objective", choices=("latency", "throughput"), default="latency",
              help="what the planner minimises (default latency)")
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
        from tfnb.notebook.widgets import PlacementEditor

        try:
            editor = PlacementEditor(self.shell.user_ns[name], **kw)
        except TfnbError as e:
            raise UsageError(f"%tfplace: {e}") from None
        if output:
            self.shell.user_ns[output] = editor
        return editor

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
    from tfnb.notebook.stream import enable

    enable(ipython)  # live text for generate calls, in Jupyter kernels only
    show_figures_inline(ipython)
