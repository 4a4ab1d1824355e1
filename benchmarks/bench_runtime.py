"""Tokens/s of tfnb's placed runtime vs HF's XLA generate, in one process.

Greedy, batch 1, ``--new`` new tokens (default 48), on the tiny random llama and on SmolLM2-135M.
tfnb runs on 1 and 2 logical CPU devices (the model split evenly). Every figure is the best of
``--repeat`` timed calls (interleaved across runners) after one warm-up call, which compiles;
the machine is shared and noisy, so compare ratios from one run.

Run::

    TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=2 \
        python benchmarks/bench_runtime.py --models tiny smollm2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tfnb.models.model import load_model, tiny
from tfnb.runtime import place_llama as place


def bench_model(model, prompt_ids, new, repeat, which, devices=None):
    """(label, best tokens/s, first-call seconds) per runner; timed calls are interleaved so
    load from other processes hits every runner alike."""
    runners = []  # (label, call, count_new_tokens)
    if "hf" in which:
        hf = model.to_hf()
        # no EOS: every runner makes all `new` tokens (HF's XLA loop ignores min_new_tokens)
        hf.generation_config.eos_token_id = None
        hf.config.eos_token_id = None
        xla_generate = tf.function(hf.generate, jit_compile=True)
        ids = tf.constant([prompt_ids], tf.int32)
        runners.append(("HF generate, XLA",
                        lambda: xla_generate(ids, max_new_tokens=new, do_sample=False,
                                             pad_token_id=0),
                        lambda out: out.shape[1] - len(prompt_ids)))
    for n_dev, xla_loop in ((1, True), (1, False), (2, False)):
        if f"tfnb{n_dev}" not in which:
            continue
        pm = place(model, devices[:n_dev] if devices else
                   [f"/device:CPU:{i}" for i in range(n_dev)])
        pm.xla_loop = xla_loop
        pm.eos_ids = ()  # no EOS: generate all `new` tokens
        loop = ", XLA loop" if n_dev == 1 and xla_loop else ", graph loop"
        where = "worker" if devices else "device"
        runners.append((f"tfnb, {n_dev} {where}{'s' * (n_dev > 1)}{loop}",
                        lambda pm=pm: pm.generate_ids(prompt_ids, max_new_tokens=new), len))
    first, rates = {}, {label: [] for label, _, _ in runners}
    for label, call, _ in runners:
        t = time.perf_counter()
        call()
        first[label] = time.perf_counter() - t
    for _ in range(repeat):
        for label, call, count in runners:
            t = time.perf_counter()
            out = call()
            rates[label].append(count(out) / (time.perf_counter() - t))
    return [(label, max(rates[label]), first[label]) for label, _, _ in runners]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--which", nargs="+", default=["hf", "tfnb1", "tfnb2"])
    ap.add_argument("--cluster", action="store_true",
                    help="place on 2 TF worker processes on 127.0.0.1 instead of logical devices")
    args = ap.parse_args(argv)
    devices = None
    if args.cluster:
        import warnings

        import tfnb
        from tfnb.cluster import LocalCluster

        local = LocalCluster(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            devices = tfnb.connect(local, timeout=10.0).devices
    for name in args.models:
        model = tiny("llama") if name == "tiny" else load_model(name, progress=False)
        if name == "tiny":
            prompt = model.tokenizer.encode("Hello, how are you?")
        else:
            prompt = model.tokenizer.encode(model.tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is the capital of France?"}]))
        rows = bench_model(model, prompt, args.new, args.repeat, args.which, devices)
        hf_rate = next((r for n, r, _ in rows if n.startswith("HF")), None)
        print(f"\n{name}: batch 1, greedy, {args.new} new tokens, prompt {len(prompt)} tokens")
        print(f"{'runner':<32}{'tokens/s':>10}{'vs HF XLA':>11}{'first call s':>14}")
        for label, rate, warm in rows:
            ratio = f"{rate / hf_rate:.2f}x" if hf_rate else "-"
            print(f"{label:<32}{rate:>10.1f}{ratio:>11}{warm:>14.1f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
