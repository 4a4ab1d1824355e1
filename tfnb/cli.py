"""The ``tfnb`` command: ``worker`` (one TF server on a real machine), ``local`` (N workers here),
``demo`` and ``bench``."""
from __future__ import annotations

import argparse
import sys


def _worker(a) -> int:
    from tfnb.cluster.worker import serve

    return serve(a.cluster, a.job, a.task, profiler_port=a.profiler_port, cpus=a.cpus)


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
        print(f"tfnb bench: unknown configuration {bad[0]!r}; expected some of {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    run_all(configs, a.new_tokens, a.repeat, a.out)
    return 0


def _demo(a) -> int:
    from tfnb.demo import run_demo

    run_demo(a.out, a.notebook)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tfnb", description="TensorFlow clusters for LLM inference from notebooks")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="run one TF worker server on this machine")
    w.add_argument("--cluster", required=True,
                   help="'host:port,host:port', a JSON dict of jobs, or a JSON cluster file")
    w.add_argument("--job", default="worker", help="job name of this task (default: worker)")
    w.add_argument("--task", type=int, default=0, help="task index of this server in its job")
    w.add_argument("--profiler-port", type=int, default=None,
                   help="also start a TF profiler server on this port")
    w.add_argument("--cpus", default=None,
                   help="pin the worker to these CPUs, e.g. '0-3' (default: all it may use)")
    w.set_defaults(func=_worker)
    lo = sub.add_parser("local", help="run N TF workers on 127.0.0.1 until Ctrl-C")
    lo.add_argument("-n", type=int, default=2, help="number of workers (default 2)")
    lo.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for them to start")
    lo.add_argument("--isolate", action="store_true", help="drop non-loopback traffic to them (root, nftables)")
    lo.set_defaults(func=_local)
    d = sub.add_parser("demo", help="local cluster, SmolLM2 placed over it, an answer, a profile")
    d.add_argument("--out", default="demo-output", help="folder for the profile figure and notebook")
    d.add_argument("--notebook", default="notebooks/01-quickstart.ipynb",
                   help="tutorial to execute into --out ('' to skip)")
    d.set_defaults(func=_demo)
    b = sub.add_parser("bench", help="generate speed of tfnb vs Hugging Face and the tf.device recipe")
    b.add_argument("--configs", nargs="+", default=None, help="subset of: hf-eager hf-xla tf-device tfnb-1 tfnb-2")
    b.add_argument("--new-tokens", type=int, default=48, help="new tokens per generate (default 48)")
    b.add_argument("--repeat", type=int, default=2, help="timed calls per configuration (best counts)")
    b.add_argument("--out", default="benchmarks/results", help="folder for generate.md / generate.json")
    b.set_defaults(func=_bench)
    a = p.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
