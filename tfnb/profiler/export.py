"""Writing a profile for other tools: TensorBoard's profile plugin and Chrome / Perfetto."""
from __future__ import annotations

import json
import time
from pathlib import Path

from tfnb.names import short_device


def _host_name(host: str) -> str:
    if host == "client":
        return "client"
    return host.strip("/").replace("/job:", "").replace("/replica:", "-r") \
        .replace("/task:", "-t").replace("job:", "").replace("/", "-").replace(":", "-")


def tensorboard(prof, logdir) -> str:
    """``logdir/plugins/profile/<run>/<host>.xplane.pb``: the layout TensorBoard's profiler
    reads."""
    run = Path(logdir) / "plugins" / "profile" / time.strftime("%Y_%m_%d_%H_%M_%S")
    run.mkdir(parents=True, exist_ok=True)
    for host, data in prof.spaces.items():
        (run / f"{_host_name(host)}.xplane.pb").write_bytes(data)
    return str(run)


def chrome_trace(prof, path) -> str:
    """Trace Event Format JSON (``chrome://tracing``, ui.perfetto.dev): one process per device,
    one thread per traced thread, times in µs since the block started (merged clock)."""
    events, tids = [], {}
    for pid, dev in enumerate(prof.devices):
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": short_device(dev)}})
    pids = {d: i for i, d in enumerate(prof.devices)}
    for e in prof.events:
        tid = tids.setdefault((e.device, e.thread), len(tids))
        args = {"op": e.op, "step": e.step}
        if e.stats:
            args.update({k: v for k, v in e.stats.items()
                         if isinstance(v, (str, int, float, bool)) or v is None})
        events.append({"ph": "X", "name": e.name, "cat": e.category, "pid": pids[e.device],
                       "tid": tid, "ts": e.start / 1e3, "dur": e.dur / 1e3, "args": args})
    for (dev, thread), tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pids[dev], "tid": tid,
                       "args": {"name": thread}})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return str(path)
