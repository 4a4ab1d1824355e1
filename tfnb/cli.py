"""The ``tfnb`` command: ``worker`` (one TF server on a real machine), ``local`` (N workers here),
``demo`` and ``bench``.

TensorFlow's own start-up and shutdown log lines (CUDA probing on machines without a GPU, oneDNN
notices, absl's pre-init warning, failed remote clean-ups at exit) are filtered out of stderr
unless ``--verbose`` is given; see :mod:`tfnb.cluster.tflog`.
"""
from __future__ import annotations

import argparse
import sys


def _worker(a) -> int:
    from tfnb.cluster.worker import serve

    return serve(a.cluster, a.job, a.task, profiler_port=a.profiler_port, cpus=a.cpus,
                 gpu=a.gpu)


def _local(a) -> int:
    import signal
    import threading

    from tfnb.cluster import LocalCluster
    from tfnb.errors import TfnbError

    try:
        lc = LocalCluster(a.n, timeout=a.timeout, isolate=a.isolate)
    except TfnbError as e:
        print(f"tfnb local: {e}", file=sys.stderr)
        return 1
    print(f"{len(lc.addresses)} workers running; connect with:")
    print(f"  %tfcluster connect {','.join(lc.addresses)}")
    for name, scope in lc.scopes().items():
        print(f"  {name} listens on {scope}")
    print("Ctrl-C stops them.", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if not all(lc.alive()):
            print("a worker exited; stopping the others", file=sys.stderr)
            break
    lc.close()
    return 0


def _bench(a) -> int:
    from tfnb.bench import CONFIGS, run_all

    configs = a.configs or list(CONFIGS)
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        print(f"tfnb bench: unknown configuration {bad[0]!r}; expected some of "
              f"{', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    run_all(configs, a.new_tokens, a.repeat, a.out)
    return 0


def _demo(a) -> int:
    from tfnb.demo import run_demo

    run_demo(a.out, a.notebook, model=a.model)
    return 0


def _quiet(verbose: bool) -> None:
    """Unless ``verbose``: TF's C++ logging at warnings and above, and its known noise dropped."""
    import os

    if verbose:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfnb.cluster.tflog import filter_stderr

    filter_stderr()


def main(argv: list[str] | None = None) -> int:
    """Run the ``tfnb`` command line.

    Examples
    --------
    >>> main(["local", "-n", "2"])                 # doctest: +SKIP
    """
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="show TensorFlow's own start-up and shutdown log lines")
    p = argparse.ArgumentParser(prog="tfnb",
                                description="TensorFlow clusters for LLM inference from notebooks",
                                parents=[verbose])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, **kw):
        return sub.add_parser(name, parents=[verbose], **kw)

    w = add("worker", help="run one TF worker server on this machine")
    w.add_argument("--cluster", required=True,
                   help="'host:port,host:port', a JSON dict of jobs, or a JSON cluster file")
    w.add_argument("--job", default="worker", help="job name of this task (default: worker)")
    w.add_argument("--task", type=int, default=0, help="task index of this server in its job")
    w.add_argument("--profiler-port", type=int, default=None,
                   help="also start a TF profiler server on this port")
    w.add_argument("--cpus", default=None,
                   help="pin the worker to these CPUs, e.g. '0-3' (default: all it may use)")
    w.add_argument("--gpu", default=None,
                   help="the GPUs this worker uses, e.g. '0' or '0,1' (nvidia-smi's numbers), "
                        "memory growing as used; 'none' for none (default: what TF finds)")
    w.set_defaults(func=_worker)
    lo = add("local", help="run N TF workers on 127.0.0.1 until Ctrl-C")
    lo.add_argument("-n", type=int, default=2, help="number of workers (default 2)")
    lo.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for them to start")
    lo.add_argument("--isolate", action="store_true",
                    help="drop non-loopback traffic to them (root, nftables)")
    lo.set_defaults(func=_local)
    d = add("demo", help="local cluster, SmolLM2 placed over it, an answer, a profile")
    d.add_argument("--out", default="demo-output",
                   help="folder for the profile figure and notebook")
    d.add_argument("--notebook", default="notebooks/01-quickstart.ipynb",
                   help="tutorial to execute into --out ('' to skip)")
    d.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                   help="smollm2 (default) or tiny: a small random model, for a quick check of "
                        "the path")
    d.set_defaults(func=_demo)
    b = add("bench", help="generate speed of tfnb vs Hugging Face and the tf.device recipe")
    b.add_argument("--configs", nargs="+", default=None,
                   help="subset of: hf-eager hf-xla tf-device tfnb-1 tfnb-2")
    b.add_argument("--new-tokens", type=int, default=48,
                   help="new tokens per generate (default 48)")
    b.add_argument("--repeat", type=int, default=2,
                   help="timed calls per configuration (best counts)")
    b.add_argument("--out", default="benchmarks/results",
                   help="folder for generate.md / generate.json")
    b.set_defaults(func=_bench)
    a = p.parse_args(argv)
    _quiet(getattr(a, "verbose", False))
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
