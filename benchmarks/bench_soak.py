"""Soak: SmolLM2-135M served for 20 minutes by two replicas under 16 clients, with worker 1
killed and restarted twice.

Two local workers (``LocalCluster(2)``), ``tfnb.plan(mode="replicate")``, ``tfnb.serve`` on
127.0.0.1, driven by the official ``openai`` client from 16 threads. The mix, drawn per request
from a seeded generator: half the requests stream; ``max_tokens`` from 8 to 64; one in four
samples with a seed, the rest are greedy; one in ten of the streams hangs up after its first
piece; one in twenty requests is malformed (``max_tokens=0``, an unknown role, a temperature
of -1) and must get a 4xx. Worker 1 is killed (SIGKILL) at 25% and at 60% of the run and
restarted 15 s later each time; the endpoint heals (``tfnb.runtime.replicas``).

It reports: requests answered, by kind; failures of valid requests, by kind (the target is
none: a copy always serves, and a request cut by a loss goes on on the other copy); p50 and p95
latency of the greedy plain requests per minute; time to heal (from the restart to the copy back
in rotation); and the resident memory (RSS) of the serving process and of each worker every
5 s, with its growth from minute 5 to the end. Writes ``benchmarks/results/soak.md`` and
``.json`` and the figure ``docs/soak.png``.

Run::

    python benchmarks/bench_soak.py [--minutes 20] [--clients 16]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import threading
import time
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Say hello.",
             "What is two plus two?", "Write a short poem about the sea.",
             "What do cats eat?", "Count from one to five.", "What is a river?"]
KILLS = (0.25, 0.60)  # when worker 1 is killed, as fractions of the run
DOWN_S = 15.0         # how long it stays down
SAMPLE_S = 5.0        # memory and state samples


def rss_mb(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


class Client(threading.Thread):
    """One client: requests until ``stop``; each as (start, end, kind, outcome, tokens)."""

    def __init__(self, url: str, index: int, stop: threading.Event, log: list):
        super().__init__(daemon=True, name=f"client-{index}")
        import openai

        self.api = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        self.rng, self.stop, self.log = random.Random(index), stop, log

    def run(self):
        import openai

        while not self.stop.is_set():
            kind, kwargs = self._draw()
            start, tokens = time.monotonic(), 0
            try:
                if kwargs.get("stream"):
                    hang_up = kind == "hang-up"
                    with self.api.chat.completions.create(**kwargs) as stream:
                        for chunk in stream:
                            tokens += bool(chunk.choices and chunk.choices[0].delta.content)
                            if hang_up and tokens:
                                break
                else:
                    out = self.api.chat.completions.create(**kwargs)
                    tokens = out.usage.completion_tokens
                outcome = "ok" if kind != "malformed" else "accepted (should be 4xx)"
            except openai.APIStatusError as e:
                outcome = (f"{e.status_code}" if kind != "malformed" or e.status_code >= 500
                           else "4xx as expected")
            except Exception as e:  # noqa: BLE001 - counted by kind
                outcome = type(e).__name__
            self.log.append((start, time.monotonic(), kind, outcome, tokens))

    def _draw(self):
        r = self.rng
        q = r.choice(QUESTIONS)
        kwargs = {"model": "smollm2", "messages": [{"role": "user", "content": q}],
                  "max_tokens": r.randint(8, 64), "temperature": 0}
        if r.random() < 0.05:
            bad = r.choice([{"max_tokens": 0}, {"temperature": -1},
                            {"messages": [{"role": "wizard", "content": q}]}])
            return "malformed", {**kwargs, **bad}
        if r.random() < 0.25:
            kwargs.update(temperature=0.8, seed=r.randint(0, 10**6))
        stream = r.random() < 0.5
        kwargs["stream"] = stream
        if stream and r.random() < 0.1:
            return "hang-up", kwargs
        sampled = kwargs["temperature"] > 0
        return ("stream" if stream else "plain") + (" sampled" if sampled else ""), kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--figure", default=os.path.join(HERE, "..", "docs", "soak.png"))
    args = ap.parse_args()

    import tfnb
    from benchmarks._results import write_results
    from tfnb.cluster import LocalCluster

    warnings.simplefilter("ignore")
    run_s = args.minutes * 60
    workers = LocalCluster(2)
    cluster = tfnb.connect(workers.addresses)
    model = tfnb.load_model("smollm2", progress=False)
    placed = tfnb.place(model, tfnb.plan(model, cluster, mode="replicate", calibrate=False),
                        cluster)
    server = tfnb.serve(placed, model="smollm2")  # warms both copies before it answers
    log: list = []
    samples: list = []
    events: list = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample():
        while not stop.wait(SAMPLE_S):
            st = placed.serving_status()
            samples.append({"t": time.monotonic() - t0, "client": rss_mb(os.getpid()),
                            "workers": [rss_mb(p) for p in workers.pids],
                            "states": [r["state"] for r in st["replicas"]],
                            "moved": st["moved"]})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    clients = [Client(server.url, i, stop, log) for i in range(args.clients)]
    for c in clients:
        c.start()
    heals = []
    for frac in KILLS:
        time.sleep(max(0.0, t0 + frac * run_s - time.monotonic()))
        workers.kill(1)
        events.append(("killed", time.monotonic() - t0))
        time.sleep(DOWN_S)
        workers.restart(1)
        restarted = time.monotonic()
        events.append(("restarted", restarted - t0))
        while time.monotonic() - restarted < 300:
            if placed.serving_status()["replicas"][1]["state"] == "serving":
                break
            time.sleep(0.5)
        heals.append(time.monotonic() - restarted)
        events.append(("healed", time.monotonic() - t0))
    time.sleep(max(0.0, t0 + run_s - time.monotonic()))
    stop.set()
    for c in clients:
        c.join(180)
    sampler.join(SAMPLE_S + 5)
    status = placed.serving_status()
    server.close()
    placed.close()
    workers.close()

    results = summarize(log, samples, heals, events, status, t0, args)
    figure(samples, events, log, t0, args.figure)
    write_results("soak", results.pop("markdown"), results)
    print(open(os.path.join(HERE, "results", "soak.md")).read())


def summarize(log, samples, heals, events, status, t0, args) -> dict:
    kinds: dict = {}
    failures: dict = {}
    for _, _, kind, outcome, _ in log:
        kinds[kind] = kinds.get(kind, 0) + 1
        valid = kind != "malformed"
        if (valid and outcome != "ok") or (not valid and outcome != "4xx as expected"):
            failures[f"{kind}: {outcome}"] = failures.get(f"{kind}: {outcome}", 0) + 1
    minutes = []
    for m in range(int(args.minutes + 0.999)):
        lat = sorted(end - start for start, end, kind, outcome, _ in log
                     if kind == "plain" and outcome == "ok" and m * 60 <= start - t0 < (m + 1) * 60)
        if lat:
            minutes.append((m, len(lat), statistics.median(lat),
                            lat[min(len(lat) - 1, int(0.95 * len(lat)))]))

    def growth(key, index=None):
        def at(s):
            v = s[key] if index is None else s[key][index]
            return v
        early = [at(s) for s in samples if 290 <= s["t"] <= 310 and at(s)]
        late = [at(s) for s in samples[-3:] if at(s)]
        if not early or not late:
            return None
        return early[0], late[-1], late[-1] / early[0] - 1

    mem = {"client": growth("client"), "worker 0": growth("workers", 0)}
    md = [f"# Soak: SmolLM2 served by 2 replicas, {args.clients} clients, "
          f"{args.minutes:g} min, worker 1 killed twice",
          "", f"`python benchmarks/bench_soak.py --minutes {args.minutes:g} --clients "
          f"{args.clients}`, {time.strftime('%Y-%m-%d')}, {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores.", "",
          f"Requests: {len(log)}; moved to the other copy after a loss: {status['moved']}.", "",
          "| kind | requests |", "|---|---:|"]
    md += [f"| {k} | {n} |" for k, n in sorted(kinds.items())]
    md += ["", "Failures (a valid request not answered, or a malformed one not refused with a "
           "4xx):", ""]
    md += [f"- {k}: {n}" for k, n in sorted(failures.items())] or ["- none"]
    md += ["", "Time to heal, from the restart to the copy back in rotation: "
           + ", ".join(f"{h:.1f} s" for h in heals) + ".", "",
           "| memory (RSS) | at 5 min | at the end | growth |", "|---|---:|---:|---:|"]
    for who, g in mem.items():
        md.append(f"| {who} | {g[0]:.0f} MB | {g[1]:.0f} MB | {100 * g[2]:+.1f}% |" if g
                  else f"| {who} | - | - | - |")
    md += ["", "Worker 1 restarts with each kill, so its memory is not compared.", "",
           "| minute | greedy plain requests | p50 latency | p95 latency |",
           "|---:|---:|---:|---:|"]
    md += [f"| {m} | {n} | {p50:.2f} s | {p95:.2f} s |" for m, n, p50, p95 in minutes]
    md += ["", "Events (seconds from the start): "
           + ", ".join(f"{what} {t:.0f}" for what, t in events) + ".", ""]
    return {"markdown": "\n".join(md), "requests": len(log), "kinds": kinds,
            "failures": failures, "heal_s": heals, "moved": status["moved"],
            "memory": mem, "minutes": minutes, "events": events, "samples": samples,
            "minutes_run": args.minutes, "clients": args.clients}


def figure(samples, events, log, t0, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lx) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    t = [s["t"] / 60 for s in samples]
    ax.plot(t, [s["client"] for s in samples], label="serving process")
    for i, name in enumerate(("worker 0", "worker 1")):
        ax.plot(t, [s["workers"][i] for s in samples], label=name)
    ax.set_ylabel("RSS (MB)")
    ax.legend(loc="lower right", fontsize=8)
    done = [(start - t0, end - start) for start, end, kind, outcome, _ in log
            if kind == "plain" and outcome == "ok"]
    lx.plot([s / 60 for s, _ in done], [d for _, d in done], ".", markersize=2)
    lx.set_ylabel("greedy request latency (s)")
    lx.set_xlabel("minutes")
    for what, at in events:
        for a in (ax, lx):
            a.axvline(at / 60, color={"killed": "red", "restarted": "orange"}.get(what, "green"),
                      linewidth=0.8, linestyle="--")
    fig.suptitle("SmolLM2, 2 replicas, worker 1 killed and restarted twice "
                 "(red: killed, orange: restarted, green: healed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
