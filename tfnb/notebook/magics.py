"""IPython magics: thin wrappers that parse arguments and call one core function each.

Bad arguments raise :class:`IPython.core.error.UsageError` (IPython shows one line, no traceback)
before any state changes; errors tfnb raises on purpose are shown the same way.
"""
from __future__ import annotations

import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from tfnb.errors import TfnbError

_ACTIONS = ("local", "connect", "status", "disconnect", "stop")


def _flags_for(action: str) -> set[str]:
    return {"local": {"timeout", "isolate", "output"},
            "connect": {"timeout", "tf_config", "file", "advertise", "output"},
            "status": {"timeout", "output"}}.get(action, set())


def parse_tfcluster(line: str) -> tuple[str, dict, str | None]:
    """Parse a ``%tfcluster`` line into (action, keyword arguments of its function, output name).

    Raises UsageError naming the bad value. Pure: touches no cluster.
    """
    try:
        shlex.split(line)
    except ValueError as e:
        raise UsageError(f"%tfcluster: cannot parse {line!r}: {e}") from None
    args = parse_argstring(TfnbMagics.tfcluster, line)
    action = args.action
    if action not in _ACTIONS:
        raise UsageError(f"%tfcluster: unknown action {action!r}; expected one of {', '.join(_ACTIONS)}")
    given = {k for k, v in vars(args).items() if k not in ("action", "target") and v not in (None, False)}
    extra = given - _flags_for(action)
    if extra:
        flag = sorted(extra)[0].replace("_", "-")
        raise UsageError(f"%tfcluster {action}: option --{flag} does not apply; "
                         f"it takes {', '.join('--' + f.replace('_', '-') for f in sorted(_flags_for(action))) or 'no options'}")
    if args.output is not None and not args.output.isidentifier():
        raise UsageError(f"%tfcluster: -o {args.output!r} is not a valid variable name")
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


@magics_class
class TfnbMagics(Magics):
    """``%tfcluster`` (and, as they land, ``%tfplace`` and ``%%tfprofile``)."""

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


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(TfnbMagics)
