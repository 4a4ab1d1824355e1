"""Check tfnb on a TensorFlow GPU host: SmolLM2 packed on ``/GPU:0`` of a ``tfnb worker --gpu 0``.

NOT RUN ON A GPU BY THE PROJECT: the machines tfnb is developed on have no GPU that TensorFlow
can use (docs/gpu.md says what was verified and what was not). Run it on your own GPU host::

    pip install "tensorflow[and-cuda]==2.21.*" && pip install -e .
    python benchmarks/gpu_check.py            # writes benchmarks/results/gpu_check.{md,json}

It starts one local worker on GPU 0 (XLA dumping its optimized HLO to a folder), places SmolLM2
there (packed: the XLA route, compact weights), and checks:

1. the answer: greedy tokens equal to a float32 placement's on the worker's CPU for a few
   prompts (or how many positions agree, if the GPU's float math breaks a near-tie), and
   "Paris" in the chat answer;
2. the weights stay compact: the bytes held on the GPU against float32's, and no float32 array
   the size of a weight matrix among the buffers of the compiled decode loop's optimized HLO;
3. decode tokens/s at batch 1 and 8 against Hugging Face's XLA ``generate`` on the same GPU.

On a host with several GPUs, ``--gpu`` numbers them as nvidia-smi does.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
PROMPT_IDS = list(range(100, 120))


def best_rate(call, tokens: int, repeat: int) -> float:
    call()
    best = min(_timed(call) for _ in range(repeat))
    return tokens / best


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def materialized_f32(hlo: str) -> set[str]:
    """The float32 shapes that are buffers (not values inside a fusion) of an optimized HLO."""
    fused = set(re.findall(r"calls=(%[\w.-]+)", hlo))
    shapes: set[str] = set()
    for comp in re.split(r"\n(?=%|ENTRY)", hlo):
        if comp.split(" ", 1)[0] not in fused:
            shapes.update(re.findall(r"f32\[[\d,]+\]", comp))
    return shapes


def matrix_shapes(cfg) -> set[str]:
    """float32 shapes a widened weight matrix of ``cfg`` would have."""
    D, F, V = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    out = set()
    for rows, cols in ((qkv, D), (D, cfg.n_heads * cfg.head_dim), (2 * F, D), (D, F), (V, D)):
        out |= {f"f32[{rows},{cols}]", f"f32[{cols},{rows}]", f"f32[{rows},{cols // 32},32]"}
    return out


def main() -> int:
    import tensorflow as tf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="0")
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    for gpu in tf.config.list_physical_devices("GPU"):
        # this process (the notebook's) would otherwise take the whole GPU the worker needs
        tf.config.experimental.set_memory_growth(gpu, True)
    if not tf.config.list_physical_devices("GPU"):
        print("gpu_check: this TensorFlow sees no GPU; install tensorflow[and-cuda] on a GPU "
              "host (docs/gpu.md)", file=sys.stderr)
        return 2
    dump = tempfile.mkdtemp(prefix="tfnb-gpu-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_dump_to={dump} --xla_dump_hlo_as_text").strip()
    import tfnb
    from benchmarks._results import write_results

    cluster = tfnb.local(1, gpus=a.gpu)
    gpus = [d for d in cluster.devices if "GPU" in d]
    cpu = next(d for d in cluster.devices if "CPU" in d)
    if not gpus:
        print(f"gpu_check: the worker has no GPU device: {cluster.devices}", file=sys.stderr)
        return 2
    report: dict = {"device": gpus[0], "tensorflow": tf.__version__}
    packed = tfnb.load_model("smollm2", progress=False)
    floats = tfnb.load_model("smollm2", weights="float32", progress=False)
    on_gpu = tfnb.place(packed, [gpus[0]], cluster)
    reference = tfnb.place(floats, [cpu], cluster)
    report["routes"] = on_gpu.route_summary()
    agree = total = 0
    for prompt in PROMPTS:
        got = on_gpu.generate_ids(prompt, max_new_tokens=24)
        want = reference.generate_ids(prompt, max_new_tokens=24)
        same = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), len(want))
        agree, total = agree + same, total + len(want)
    report["greedy tokens equal to float32 on the CPU"] = f"{agree}/{total}"
    answer = on_gpu.chat("What is the capital of France?", max_new_tokens=10)
    report["answer"] = answer
    held = sum(int(v.shape.num_elements()) * v.dtype.size for v in on_gpu.variables)
    report["bytes on the GPU"] = held
    report["float32 bytes"] = sum(int(v.shape.num_elements()) * v.dtype.size
                                  for v in reference.variables)
    del reference
    # the decode loops compiled so far: the packed placement's, one sequence at a time (the
    # float32 reference's hold no int8 or uint8 weights; a batch's dequantized dot, compiled
    # below, makes a float32 matrix per step by design)
    loops = [text for path in sorted(glob.glob(os.path.join(dump, "*decode_loop*"
                                                            "after_optimizations.txt")))
             for text in [open(path).read()] if re.search(r"\b[su]8\[\d+,\d+\]", text)]
    widened = set()
    for text in loops:
        widened |= materialized_f32(text) & matrix_shapes(packed.config)
    report["packed decode loops dumped"] = len(loops)
    report["float32 weight matrices among their buffers"] = sorted(widened) or "none"

    on_gpu.eos_ids = ()
    for B in (1, 8):
        report[f"tfnb tokens/s, batch {B}"] = best_rate(
            lambda B=B: on_gpu.generate_ids([PROMPT_IDS] * B, max_new_tokens=a.new),
            B * a.new, a.repeat)
    hf = floats.to_hf()
    hf.generation_config.eos_token_id = hf.config.eos_token_id = None
    with tf.device("/GPU:0"):
        generate = tf.function(hf.generate, jit_compile=True)
        for B in (1, 8):
            ids = tf.constant([PROMPT_IDS] * B, tf.int32)
            report[f"HF XLA generate tokens/s, batch {B}"] = best_rate(
                lambda ids=ids: generate(ids, max_new_tokens=a.new, do_sample=False,
                                         pad_token_id=0), B * a.new, a.repeat)
    cluster.stop()
    ok = ("Paris" in answer and held <= 0.35 * report["float32 bytes"] and loops
          and not widened)
    report["verdict"] = "ok" if ok else "CHECK FAILED"
    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    md = ["# tfnb on a GPU", "", f"{time.strftime('%Y-%m-%d %H:%M')}, "
          f"{details.get('device_name', 'GPU')}", "", "| check | result |", "|---|---|"]
    md += [f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |"
           for k, v in report.items()]
    write_results("gpu_check", "\n".join(md) + "\n", report)
    print("\n".join(md))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
