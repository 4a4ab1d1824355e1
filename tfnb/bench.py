"""``tfnb bench``: generate speed of tfnb against the usual ways, measured in one run.

Every configuration runs in its own fresh Python process (so each has a clean TF context and an
honest peak memory), on the same model, prompt and number of new tokens, greedy, batch 1:

1. ``hf-eager``   Hugging Face TF ``generate``, eager, one process;
2. ``hf-xla``     the same inside ``tf.function(jit_compile=True)``;
3. ``tf-device``  the common recipe over 2 local workers: a ``tf.device`` scope around each
                  block's call, weights left on the client, eager HF ``generate``;
4. ``tfnb-1``     tfnb on 1 local worker;
5. ``tfnb-2``     tfnb over 2 local workers.

Tokens/s counts new tokens over the whole generate call (prefill included), best of ``repeat``
calls after a warm-up call that compiles; time to first token is a 2-token generate minus one
decode step (HF's XLA generate cannot make a single token), likewise warmed up. Peak memory is
the high-water RSS of the client and of each worker process.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import tfnb
from tfnb.cluster.security import ExposedServerWarning
from tfnb.models.chain import block_stage

CONFIGS = ("hf-eager", "hf-xla", "tf-device", "tfnb-1", "tfnb-2")
PROMPT = "What is the capital of France?"


def _peak_rss_mb(pid: int | None = None) -> float:
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _timed(fn, repeat: int) -> float:
    fn()  # warm-up (compiles)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _hf_runner(model, ids, config: str, cluster=None):
    import tensorflow as tf

    hf = model.to_hf()
    hf.generation_config.eos_token_id = None  # generate exactly n tokens, as every configuration
    hf.config.eos_token_id = None
    if config == "tf-device":
        from tfnb.runtime.devices import even_split  # tfnb.runtime imports TensorFlow

        blocks = [block_stage(i) for i in range(model.config.n_layers)]
        where = even_split(blocks, cluster.devices)
        for i, layer in enumerate(hf.model.layers):
            layer.call = _on_device(layer.call, where[block_stage(i)])
    x = tf.constant([ids], tf.int32)
    def make(n):
        def gen(input_ids):
            return hf.generate(input_ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
        fn = tf.function(gen, jit_compile=True) if config == "hf-xla" else gen
        return lambda: fn(x)

    return make


def _on_device(call, device):
    import tensorflow as tf

    def wrapped(*args, **kwargs):
        with tf.device(device):
            return call(*args, **kwargs)
    return wrapped


def run_one(config: str, new_tokens: int = 48, repeat: int = 2,
            model_name: str = "smollm2") -> dict:
    """Measure one configuration in this process; returns a row of the results table."""
    warnings.simplefilter("ignore", ExposedServerWarning)
    model = tfnb.load_model(model_name, progress=False)
    ids = model.tokenizer.encode(
        model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    cluster = None
    if config in ("tf-device", "tfnb-1", "tfnb-2"):
        cluster = tfnb.local(1 if config == "tfnb-1" else 2)
    try:
        if config.startswith("tfnb"):
            split = {"max_memory": "100MB"} if config == "tfnb-2" else {}  # force both workers
            placed = tfnb.place(model, tfnb.plan(model, cluster, **split), cluster)
            placed.eos_ids = ()  # every configuration generates exactly new_tokens tokens

            def make(n):
                return lambda: placed.generate_ids(ids, max_new_tokens=n)
        else:
            make = _hf_runner(model, ids, config, cluster)
        total = _timed(make(new_tokens), repeat)
        # HF's XLA generate cannot make a single token, so every configuration derives the time
        # to first token the same way: a 2-token call minus one decode step.
        two = _timed(make(2), repeat)
        ttft = two - (total - two) / (new_tokens - 2)
        row = {"config": config, "tokens_per_s": new_tokens / total, "ttft_ms": ttft * 1e3,
               "client_peak_mb": _peak_rss_mb(),
               "worker_peak_mb": [_peak_rss_mb(p) for p in cluster.local.pids] if cluster else [],
               "new_tokens": new_tokens}
    finally:
        if cluster is not None:
            cluster.stop()
    return row


def machine() -> str:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(ln.split(":", 1) for ln in f.read().split("\n\n")[0].splitlines()
                        if ":" in ln)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu = f"{info['model name']}, family {info.get('cpu family', '?')}"
    except (OSError, KeyError):
        pass
    try:  # which code the packed matmuls run: the figures depend on it
        from tfnb import kernels
        isa = f", packed kernels {kernels.isa()}"
    except Exception:  # noqa: BLE001 - no compiler: the float32 path still measures
        isa = ""
    return (f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"no GPU, Python {platform.python_version()}{isa}")


def to_markdown(rows: list[dict], base: str = "hf-xla") -> str:
    ref = next((r["tokens_per_s"] for r in rows if r["config"] == base), None)
    lines = ["| configuration | tokens/s | × HF XLA | time to first token | client peak RSS "
             "| worker peak RSS |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "-"
        workers = " + ".join(f"{m:.0f}" for m in r["worker_peak_mb"]) or "-"
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['ttft_ms']:.0f} ms | {r['client_peak_mb']:.0f} MB | {workers} MB |")
    return "\n".join(lines)


def run_all(configs=CONFIGS, new_tokens: int = 48, repeat: int = 2,
            out_dir: str = "benchmarks/results") -> list[dict]:
    """Run each configuration in a fresh process; write ``generate.md`` and ``generate.json``."""
    rows = []
    for config in configs:
        print(f"[bench] {config} ...", flush=True)
        res = subprocess.run([sys.executable, "-m", "tfnb.bench", config, str(new_tokens),
                              str(repeat)], capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("{")), None)
        if res.returncode != 0 or line is None:
            raise RuntimeError(f"benchmark {config} failed: {res.stderr.strip().splitlines()[-1:]}")
        rows.append(json.loads(line))
        print(f"[bench] {config}: {rows[-1]['tokens_per_s']:.2f} tokens/s", flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = to_markdown(rows)
    header = (f"SmolLM2-135M-Instruct, greedy, batch 1, {new_tokens} new tokens, prompt {PROMPT!r} "
              f"(chat template); {machine()}; {time.strftime('%Y-%m-%d')}.\n\n")
    (out / "generate.md").write_text(header + table + "\n")
    (out / "generate.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    print(header + table)
    return rows


if __name__ == "__main__":
    config, n, rep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(run_one(config, n, rep)), flush=True)
