"""Planning on paper: models described by a GGUF header or a shape, clusters by their figures."""
import os
import re

import gguf
import numpy as np
import pytest

import tfnb
from tfnb.errors import ModelError, PlacementError
from tfnb.models.decoder import LlamaConfig, weight_shapes
from tfnb.models.describe import file_types
from tfnb.models.gguf_io import _reader_class
from tfnb.models.model import smollm2_path
from tfnb.placement import Topology, describe_cluster, plan
from tfnb.placement.cost import step_bytes

# Llama 3.1 70B's shape
LLAMA_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
GB = 10**9
# GGUF names of the canonical llama weights (blocks.{i}.<short>)
_BLOCK = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
          "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
          "w_down": "ffn_down"}
_MODEL = {"embed": "token_embd", "final_norm": "output_norm", "lm_head": "output"}


def _llama_70b():
    return tfnb.describe_model(**LLAMA_70B, weights="Q4_K_M")


def write_header_only_gguf(path, config: LlamaConfig, types: dict) -> int:
    """A GGUF file of ``config`` with tensors of ``types`` whose data region is a hole: the
    header and tensor table are written, the file is then extended to its full size without
    writing (a sparse file). Returns the bytes of tensor data it declares."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("described-70b")
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.ffn_size)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    declared = 0
    for name, shape in weight_shapes(config).items():
        parts = name.split(".")
        gname = f"blk.{parts[1]}.{_BLOCK[parts[2]]}" if parts[0] == "blocks" else _MODEL[name]
        rows_cols = shape if len(shape) == 1 or name == "embed" else shape[::-1]  # (out, in)
        qt = gguf.GGMLQuantizationType[types[name]]
        block, size = gguf.GGML_QUANT_SIZES[qt]  # gguf's own table, not tfnb's
        nbytes = int(np.prod(rows_cols)) // block * size
        writer.add_tensor_info(f"{gname}.weight", rows_cols, np.float32, nbytes, raw_dtype=qt)
        declared += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    end = writer.fout[0].tell()
    writer.close()
    padded = sum(gguf.GGUFWriter.ggml_pad(t.nbytes, 32) for t in writer.tensors[0].values())
    os.truncate(path, gguf.GGUFWriter.ggml_pad(end, 32) + padded)
    return declared


def _peak_rss_growth(fn):
    """``(fn(), bytes)``: how far the process's peak resident memory rose above its resident
    memory before the call (file pages read through a map count)."""
    def status(key):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the current resident size
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here: the peak cannot be reset")
    before = status("VmRSS:")
    out = fn()
    return out, status("VmHWM:") - before


def test_header_chain_is_the_loaded_models_chain():
    path = smollm2_path()
    described = tfnb.describe_model(path)
    model = tfnb.load_model("smollm2", progress=False)
    assert list(described) == list(model.chain)   # names, bytes, FLOPs, KV, weight names
    assert described.unique_param_bytes == model.nbytes
    # loaded as float32, every weight takes 4 bytes a value
    assert tfnb.describe_model(path, weights="float32").unique_param_bytes == 4 * model.n_params


def test_a_70b_file_is_described_from_its_header_without_reading_its_data(tmp_path):
    config = LlamaConfig(vocab_size=128256, hidden_size=8192, n_layers=80, n_heads=64,
                         n_kv_heads=8, ffn_size=28672, max_context=131072, tie_embeddings=False)
    path = tmp_path / "llama-70b-Q4_K_M.gguf"
    declared = write_header_only_gguf(path, config, file_types(config, "Q4_K_M"))
    st = os.stat(path)
    assert st.st_size > 42 * GB and st.st_blocks * 512 < 20 * 10**6  # 42 GB, of which a hole
    chain, grew = _peak_rss_growth(lambda: tfnb.describe_model(path))
    assert grew < 64 * 10**6, f"describing a {st.st_size / GB:.0f} GB file took {grew:,} bytes"
    assert chain.unique_param_bytes == declared
    assert list(chain) == list(_llama_70b())  # the file's types give what the shape predicts


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
def test_the_shape_types_every_tensor_as_llama_quantize_did(file_type):
    path = os.path.expanduser(f"~/.cache/tfnb/conformance/smollm2-{file_type}.gguf")
    if not os.path.exists(path):
        pytest.skip(f"{path} is written by benchmarks/conformance.py (llama-quantize)")
    reader = _reader_class()(path)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9,
                         n_kv_heads=3, ffn_size=1536)
    types = file_types(config, file_type)
    names = {v: k for k, v in _MODEL.items()}
    names.update({f"blk.{i}.{g}": f"blocks.{i}.{c}" for i in range(30) for c, g in _BLOCK.items()})
    in_file = {names[t.name.removesuffix(".weight")]: t.tensor_type.name for t in reader.tensors}
    assert in_file == types


def test_70b_on_four_24gb_hosts_fits_and_predicts_its_speed_from_memory_bandwidth():
    chain = _llama_70b()
    assert round(chain.total_param_bytes / GB, 1) == 42.5
    hosts = describe_cluster(4, "24GB", flops=1e12, memory_bandwidth="50GB/s", latency=2e-4,
                             bandwidth="1.25GB/s")
    p = plan(chain, hosts, objective="throughput")
    pred = p.prediction
    assert set(pred.memory) == set(hosts.devices)
    kv = sum(chain.kv_bytes(1, 1024).values())
    assert sum(pred.memory.values()) == chain.total_param_bytes + kv
    assert all(m <= 24 * GB for m in pred.memory.values())
    # a step reads every weight (but the embedding's lookup) and the cache once, at 50 GB/s
    reads = sum(step_bytes(s, 1, 1024) for s in chain) / 50e9
    assert reads < pred.latency_s < reads + 4 * (2e-4 + 32768 / 1.25e9) + 1e-3
    assert 1 / pred.latency_s == pytest.approx(1.17, abs=0.01)   # tokens/s of one sequence
    assert pred.throughput > 3.5 / pred.latency_s                 # a sequence on every host
    text = str(p)
    assert "host3" in text and "/ 24,000 MB" in text and "memory reads on host" in text
    # twice the bandwidth, twice the speed; a slow processor makes compute the limit instead
    fast = plan(chain, describe_cluster(4, "24GB", memory_bandwidth="100GB/s"))
    assert fast.prediction.latency_s == pytest.approx(pred.latency_s / 2, rel=0.01)
    slow = plan(chain, describe_cluster(4, "24GB", flops=1e10, memory_bandwidth="50GB/s"))
    assert slow.prediction.latency_s > 10 and "compute on" in slow.prediction.bottleneck


def test_70b_on_fewer_hosts_is_refused_naming_the_bytes_it_lacks():
    chain = _llama_70b()
    one = describe_cluster(1, "24GB", memory_bandwidth="50GB/s")
    need = chain.total_param_bytes + sum(chain.kv_bytes(1, 1024).values())
    with pytest.raises(PlacementError, match=re.escape(f"({need - 24 * GB:,} bytes)")):
        plan(chain, one)
    two = describe_cluster(2, "24GB", memory_bandwidth="50GB/s")
    assert len(plan(chain, two).devices) == 2   # at context 1024 two hosts hold it ...
    with pytest.raises(PlacementError) as e:   # ... with 8192 tokens of KV cache they do not
        plan(chain, two, context_len=8192)
    short = int(re.search(r"([\d,]+) bytes more on every device", str(e.value))[1]
                .replace(",", ""))
    assert short > 0
    # the figure is exact: that much more memory fits, one byte less does not
    assert plan(chain, two.with_max_memory(24 * GB + short), context_len=8192)
    with pytest.raises(PlacementError):
        plan(chain, two.with_max_memory(24 * GB + short - 1), context_len=8192)


def test_faster_memory_gets_more_of_the_model():
    chain = _llama_70b()
    hosts = describe_cluster(["fast", "slow"], "40GB", memory_bandwidth=["100GB/s", "25GB/s"])
    used = plan(chain, hosts, objective="throughput").prediction.memory
    assert used["fast"] > 2 * used["slow"]


def test_a_described_cluster_reuses_measured_speeds():
    measured = Topology(["/job:worker/replica:0/task:0/device:CPU:0",
                         "/job:worker/replica:0/task:1/device:CPU:0"], memory="8GB",
                        flops=[30e9, 50e9], latency=3e-4, bandwidth=2e9
                        ).with_memory_bandwidth({"/job:worker/replica:0/task:0/device:CPU:0": 20e9,
                                                 "/job:worker/replica:0/task:1/device:CPU:0": 30e9})
    hosts = describe_cluster(3, "24GB", like=measured)
    assert hosts.flops.tolist() == [40e9] * 3 and hosts.memory_bandwidth.tolist() == [25e9] * 3
    assert hosts.latency[0, 1] == 3e-4 and hosts.bandwidth[0, 1] == 2e9
    assert hosts.memory.tolist() == [24e9] * 3   # the memory described, not the measured one
    assert describe_cluster(3, "24GB", like=measured, bandwidth="10GB/s").bandwidth[0, 1] == 1e10
    assert len(hosts.classes()) == 1   # interchangeable hosts: the exact planner stays fast


def test_bad_descriptions_say_what_is_accepted():
    with pytest.raises(PlacementError, match="no speed given"):
        describe_cluster(4, "24GB")
    with pytest.raises(PlacementError, match=r"hosts=0: expected a number of hosts >= 1"):
        describe_cluster(0, "24GB", memory_bandwidth=1e10)
    with pytest.raises(PlacementError, match=r"memory_bandwidth='fast': expected bytes per sec"):
        describe_cluster(2, "24GB", memory_bandwidth="fast")
    with pytest.raises(PlacementError, match="like="):
        describe_cluster(2, "24GB", like="my laptop")
    with pytest.raises(ModelError, match=r"weights='Q3_K_M': expected a GGUF file type"):
        tfnb.describe_model(**LLAMA_70B, weights="Q3_K_M")
    with pytest.raises(ModelError, match="no path and no ffn"):
        tfnb.describe_model(layers=2, hidden=64, heads=4, vocab=96, weights="F16")
    with pytest.raises(ModelError, match="a path or a shape, not both"):
        tfnb.describe_model(smollm2_path(), layers=2)


@pytest.mark.parametrize("module", ["tfnb.models.describe", "tfnb.models.packed",
                                    "tfnb.placement.cost", "tfnb.placement.planners"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
