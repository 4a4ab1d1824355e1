"""Faults on a real cluster: what the user gets, how fast, and whether the model comes back.

Two local workers (``LocalCluster(2)``), the tiny llama (``tfnb.models.tiny("llama")``) placed
over both with ``timeout=60.0``, so only the liveness probes (``tfnb.runtime.faults``: a worker
silent for 3 s, probed every 2 s) can fail a call early; one row uses ``timeout=5.0``. Each case
runs once: inject the fault, time the call until it raises, note what ``cluster.status()`` and
the placed model say, then recover (SIGCONT or restart, ``cluster.reconnect()``, place again)
and check that greedy decoding gives the same 48 tokens as before any fault.

Nothing can hang the script: a separate process resumes a stopped worker after ``RESUME_S``
(a call that holds the GIL cannot freeze this process for good), each faulty call runs in a
helper thread waited for at most ``CASE_LIMIT_S``, another process kills the script after
``SCRIPT_LIMIT_S``, and the table is written after every case. A case is *bounded* when its error
came within the row's bound: liveness 2 + 3 + 2 s, the deadline + 2 s, or seconds for a dead
worker. The last case cuts a link: worker 1 in a network namespace behind a bridge whose port
goes down (packets dropped, nothing refused), as ``tests/netns.py`` does; where namespaces are
refused the row says why. Writes ``benchmarks/results/faults.md`` and ``.json``.

Run::

    python benchmarks/bench_faults.py
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

PROMPT, NEW, CHUNK = "hello world", 48, 4
LIVENESS_S = 2.0 + 3.0 + 2.0  # probe interval + probe timeout + 2 s
RESUME_S = 30                 # the watchdog process sends SIGCONT after this
CASE_LIMIT_S = 75             # longer than the 60 s deadline: a call still running is a hang
SCRIPT_LIMIT_S = 900          # the whole run (about 3 minutes on 2 cores)
NS, BRIDGE, SUBNET = "tfnbfault1", "tfnbfbr0", "198.18.79"  # own names: tests/netns.py's stay free


def timed(fn):
    """``fn()`` in a helper thread, waited for at most CASE_LIMIT_S: (outcome, seconds)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - it is what we measure
            out["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(CASE_LIMIT_S)
    took = time.monotonic() - start
    if thread.is_alive():
        return f"still running after {CASE_LIMIT_S} s", took
    return out.get("error", f"no error (returned {str(out.get('value'))[:40]})"), took


def gets(outcome) -> str:
    """What the user gets: the exception type and the start of its message."""
    if not isinstance(outcome, BaseException):
        return str(outcome)
    return f"{type(outcome).__name__}: {' '.join(str(outcome).split())[:80]}"


class Bench:
    def __init__(self):
        import tfnb
        from tfnb.cluster import LocalCluster
        from tfnb.models import tiny

        self.tfnb, self.rows = tfnb, []
        self.workers = LocalCluster(2)
        self.cluster = tfnb.connect(self.workers)
        self.model = tiny("llama")
        self.placed = self.place()
        self.expected = self.generate()  # compiles (batch 1, this length): later calls are warm

    def place(self):  # over every device of both workers
        return self.tfnb.place(self.model, self.cluster.devices, self.cluster, timeout=60.0)

    def generate(self):  # the call whose tokens must come back after every fault
        return self.placed.generate_ids(PROMPT, max_new_tokens=NEW, chunk_tokens=CHUNK)

    @contextlib.contextmanager
    def stopped(self, task):
        """SIGSTOP a worker; a separate process resumes it after RESUME_S whatever happens here."""
        pid = self.workers.pids[task]
        dog = subprocess.Popen(["sh", "-c", f"sleep {RESUME_S}; kill -CONT {pid}"])
        self.workers.kill(task, signal.SIGSTOP)
        try:
            yield
        finally:
            self.workers.kill(task, signal.SIGCONT)
            dog.kill()
            dog.wait()

    def health(self) -> str:
        """``cluster.status()`` in a few words, and whether the placement refuses calls now."""
        states = self.cluster.status(timeout=1.0).states.values()
        bad = [f"worker {i} {s}" for i, s in enumerate(states) if s != "up"]
        return f"status(): {', '.join(bad) or 'all up'}; placement refuses calls: " + \
            ("yes" if self.placed.lost else "no")

    def recover(self, task, how="SIGCONT") -> str:
        """Restart ``task`` (how="restart") or not, reconnect, place again, compare the tokens."""
        if how == "restart":
            self.workers.restart(task)
        report = self.cluster.reconnect()  # names the restarted workers and the placements lost
        self.placed = self.place()
        same = "yes" if self.generate() == self.expected else "NO"
        steps = " + ".join(x for x in (how, "reconnect", "place") if x)
        return (f"after {steps}: {len(report['restarted'])} restarted, {len(report['lost'])} "
                f"placements lost, same tokens as before: {same}")

    def add(self, case, timeout, outcome, took, bound, worker, state):
        text = str(outcome)
        named = any(w in text for w in worker) if worker else None
        self.rows.append({"case": case, "timeout_s": timeout, "gets": gets(outcome),
                          "message": " ".join(text.split())[:600], "seconds": round(took, 2),
                          "bound_s": bound, "bounded": None if bound is None else took < bound,
                          "names_worker": named, "state": state})
        write(self.rows)
        print(f"{case}: {gets(outcome)} in {took:.2f} s; {state}", flush=True)

    def names(self, task):
        return [f"task:{task}", self.workers.addresses[task]]

    # --- the cases --------------------------------------------------------------------------
    def stop_then_call(self, case, task, call, timeout=60.0):
        """SIGSTOP ``task``, then ``call()``; resume, reconnect, place again."""
        self.placed.timeout = timeout
        with self.stopped(task):
            outcome, took = timed(call)
            state = self.health()
        bound = LIVENESS_S if timeout >= LIVENESS_S else timeout + 2.0
        self.add(case, timeout, outcome, took, bound, self.names(task),
                 f"{state}; {self.recover(task)}")

    def mid_stream(self, case, fault, bound, how="SIGCONT"):
        """A compiled streaming call; after its first chunk ``fault()`` (a context), the rest."""
        stream = self.placed.generate_ids(PROMPT, max_new_tokens=NEW, chunk_tokens=CHUNK,
                                          stream=True)
        assert next(stream) == self.expected[:CHUNK]
        with fault():
            outcome, took = timed(lambda: list(stream))
            state = self.health()
        self.add(case, 60.0, outcome, took, bound, self.names(1),
                 f"{state}; {self.recover(1, how)}")

    @contextlib.contextmanager
    def killed(self, task):
        self.workers.kill(task, signal.SIGKILL)
        yield

    def restart_then_call(self):
        self.workers.restart(1)  # the new process holds none of the placement's variables
        outcome, took = timed(self.generate)
        self.add("restart worker 1, then generate on the old placement", 60.0, outcome, took, 5.0,
                 self.names(1), f"{self.health()}; {self.recover(1, None)}")

    def unreachable(self, case, address, timeout=2.0):
        """``tfnb.connect`` to worker 0 and a bad address: refused with nothing changed."""
        spec = {"worker": [self.workers.addresses[0], address]}
        outcome, took = timed(lambda: self.tfnb.connect(spec, timeout=timeout))
        same = "yes" if self.generate() == self.expected else "NO"
        self.add(case, timeout, outcome, took, timeout + 1.0, [address],
                 f"{self.health()}; the connected cluster still generates the same tokens: {same}")

    def cut_link(self):
        """Worker 0 here, worker 1 in a namespace behind a bridge; take its bridge port down."""
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        import netns  # tests/netns.py: unavailable() and _ip()

        from tfnb.cluster.local import free_ports
        from tfnb.cluster.probe import probe_all

        case = "link to worker 1 cut (network namespace), mid-stream"
        if netns.unavailable():
            return self.add(case, 60.0, f"not run: {netns.unavailable()}", 0.0, None, None,
                            "not run")

        def ip(cmd, ns=None):
            return netns._ip(*cmd.split(), ns=ns)

        spec = {"worker": [f"{SUBNET}.1:{free_ports(1)[0]}", f"{SUBNET}.11:2222"]}
        procs = []
        try:
            try:
                ip(f"link add {BRIDGE} type bridge"), ip(f"addr add {SUBNET}.1/24 dev {BRIDGE}")
                ip(f"link set {BRIDGE} up"), subprocess.run(["ip", "netns", "add", NS], check=True)
                ip(f"link add {NS}r type veth peer name {NS}n"), ip(f"link set {NS}n netns {NS}")
                ip(f"link set {NS}r master {BRIDGE}"), ip(f"link set {NS}r up")
                ip(f"addr add {SUBNET}.11/24 dev {NS}n", NS), ip(f"link set {NS}n up", NS)
                ip("link set lo up", NS), ip(f"route add default via {SUBNET}.1", NS)
                for task, prefix in enumerate([[], ["ip", "netns", "exec", NS]]):
                    procs.append(subprocess.Popen(prefix + [
                        sys.executable, "-m", "tfnb.cluster.worker", "--cluster", json.dumps(spec),
                        "--task", str(task), "--watch-stdin", "--parent-pid", str(os.getpid())],
                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL))
                deadline = time.monotonic() + 60  # until both serve
                while any(r.state != "up" for r in probe_all(spec["worker"], 2.0)):
                    assert time.monotonic() < deadline, "the workers did not start in 60 s"
                    time.sleep(1)
            except Exception as e:  # noqa: BLE001 - the machine refused, not tfnb
                return self.add(case, 60.0, f"not run: setup failed: {e}", 0.0, None, None,
                                "not run")
            cluster = self.cluster = self.tfnb.connect(spec, timeout=5.0)
            self.placed = self.place()
            before = "yes" if self.generate() == self.expected else "NO"
            stream = self.placed.generate_ids(PROMPT, max_new_tokens=NEW, chunk_tokens=CHUNK,
                                              stream=True)
            next(stream)
            ip(f"link set {NS}r down")  # the cut: packets to and from worker 1 are dropped
            outcome, took = timed(lambda: list(stream))
            state = self.health()
            ip(f"link set {NS}r up")
            deadline = time.monotonic() + 20
            while not cluster.status(timeout=1.0).all_up and time.monotonic() < deadline:
                time.sleep(0.5)
            self.add(case, 60.0, outcome, took, LIVENESS_S, ["task:1", spec["worker"][1]],
                     f"same tokens as on loopback before the cut: {before}; {state}; "
                     f"{self.recover(1, 'mending the link')}")
        finally:
            for p in procs:
                p.kill()
                p.wait(10)
            subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)
            netns._ip("link", "del", f"{NS}r", check=False)
            netns._ip("link", "del", BRIDGE, check=False)

    def run_all(self):
        from tfnb.cluster.local import free_ports

        compiled = dict(prompts=PROMPT, max_new_tokens=NEW)
        shapes = {"compiled shape": compiled,
                  "new prompt length": dict(prompts=[1] + list(range(40, 60)), max_new_tokens=40),
                  "new batch size": dict(prompts=[PROMPT, "other words", "x"], max_new_tokens=NEW)}
        for name, kw in shapes.items():
            self.stop_then_call(f"SIGSTOP worker 1, then a call ({name})", 1,
                                lambda kw=kw: self.placed.generate_ids(**kw, chunk_tokens=CHUNK))
        self.stop_then_call("SIGSTOP worker 0, then a call (compiled shape)", 0,
                            lambda: self.placed.generate_ids(**compiled, chunk_tokens=CHUNK),
                            timeout=5.0)
        self.mid_stream("SIGSTOP worker 1 during a compiled streaming call",
                        lambda: self.stopped(1), LIVENESS_S)
        self.stop_then_call("SIGSTOP worker 1, then `tfnb.place`", 1, lambda: self.place())
        self.mid_stream("SIGKILL worker 1 mid-stream", lambda: self.killed(1), 5.0, "restart")
        self.restart_then_call()
        self.unreachable("`tfnb.connect` with a port that refuses", f"127.0.0.1:{free_ports(1)[0]}")
        with contextlib.closing(socket.socket()) as silent:  # accepts TCP, never says a word
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            self.unreachable("`tfnb.connect` with a port that never answers",
                             f"127.0.0.1:{silent.getsockname()[1]}")
        self.cut_link()


def write(rows):
    md = ["# Faults: 2 local workers, tiny llama over both, greedy, 48 new tokens", "",
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}. Placed with `timeout=60.0` unless the row says "
          "otherwise; a worker that stops answering fails a call by liveness within "
          f"{LIVENESS_S:g} s. One run of each case.", "",
          "| case | timeout s | what the user gets | s to error | bounded | names the worker "
          "| state afterwards |", "|---|---|---|---|---|---|---|"]
    yn = {True: "yes", False: "**no**", None: "-"}
    for r in rows:
        bound = "" if r["bound_s"] is None else f" (< {r['bound_s']:g})"
        md.append(f"| {r['case']} | {r['timeout_s']:g} | {r['gets'].replace('|', '/')} "
                  f"| {r['seconds']:.2f} | {yn[r['bounded']]}{bound} | {yn[r['names_worker']]} "
                  f"| {r['state']} |")
    md += ["", "*names the worker*: its task or address appears in the whole message "
           "(`faults.json` has the first 600 characters of each). *placement refuses calls*: the "
           "placed model that saw the fault says it is lost (`placed.lost`) instead of trying "
           "again."]
    from _results import write_results

    write_results("faults", "\n".join(md) + "\n",
                  {"rows": rows, "liveness_bound_s": LIVENESS_S, "resume_s": RESUME_S,
                   "case_limit_s": CASE_LIMIT_S})


def main():
    warnings.simplefilter("ignore")
    dog = subprocess.Popen(["sh", "-c", f"sleep {SCRIPT_LIMIT_S}; kill -9 {os.getpid()}"])
    bench = Bench()
    try:
        bench.run_all()
    finally:
        bench.cluster.stop()
        bench.workers.close()
        dog.kill()
        dog.wait()
    print(open(os.path.join(HERE, "results", "faults.md")).read())


if __name__ == "__main__":
    main()
