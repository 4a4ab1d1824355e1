"""Workers read their stages' weights from their own copy of the model's file
(``tfnb.runtime.fileload``): on the session's real workers, with tiny quantized GGUF files
written here. What is read there must be what the client would have sent, bit for bit; a
worker's file that differs is refused before anything is placed; a worker without the file is
sent its weights."""
import os
import shutil

import numpy as np
import pytest

import tfnb
from tfnb.errors import PlacementError
from tfnb.models import decoder
from tfnb.models.packed import QTYPES, PackedTensor, widened
from tfnb.runtime import fileload

from tests.test_packed import PROMPTS, write_quantized_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """q/k/v and gate/up in types one of them holds exactly (so a fused matrix is widened on
    the worker), llama's permuted q/k rows, a Q8_0 tied embedding."""
    config = decoder.tiny_config(n_layers=3)
    path = tmp_path_factory.mktemp("fileload") / "mixed.gguf"
    write_quantized_gguf(path, config, decoder.random_weights(config, 5), {
        "embed": "Q8_0", "attn": "Q4_0", "ffn": "Q4_1",
        "blk.0.attn_v.weight": "Q8_0", "blk.1.attn_q.weight": "Q5_0",
        "blk.1.attn_v.weight": "Q8_0", "blk.2.ffn_up.weight": "Q5_1"})
    return path


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(s for s in f if s.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("source, target", [("Q4_0", "Q8_0"), ("Q5_0", "Q8_0"),
                                            ("Q4_1", "Q5_1")])
def test_blocks_widened_on_a_device_equal_numpy_widening(source, target):
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((5, 96)).astype(np.float32)
    from tfnb.models.packed import quantize_rows

    p = PackedTensor(quantize_rows(rows, QTYPES[source]), QTYPES[source], 96)
    got = fileload.widen_blocks(p.data, QTYPES[source], QTYPES[target]).numpy()
    want = widened(p, QTYPES[target])
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    # and the widened blocks hold the same values
    assert np.array_equal(PackedTensor(got, QTYPES[target], 96).rows_float32(),
                          p.rows_float32())


def test_workers_read_their_stages_from_the_file_and_answer_as_if_sent(mixed_gguf, cluster):
    model = tfnb.load_model(mixed_gguf, progress=False)
    assert all(w.parts[0].path == str(mixed_gguf) for w in model.weights.values()
               if isinstance(w, PackedTensor))
    read = tfnb.place(model, cluster.devices[:2], cluster)
    assert read.weight_sources == {"worker:0": f"read {mixed_gguf}",
                                   "worker:1": f"read {mixed_gguf}"}
    sent = tfnb.place(model, cluster.devices[:2], cluster, files=False)
    assert set(sent.weight_sources.values()) == {"sent from the client"}
    # the same bytes in every variable: widened (block 0's q/k/v, 2's gate/up) and reordered
    # (llama's q/k rows) on the worker as on the client
    for a, b in zip(read.variables, sent.variables):
        assert a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy()), a.name
    packed = [v for v in read.variables if v.dtype.name == "uint8"]
    # qkv, wo, gate_up and down per block; the tied table on both workers (lookup, head)
    assert len(packed) == 3 * 4 + 2
    assert read.generate_ids(PROMPTS, max_new_tokens=8) == \
        sent.generate_ids(PROMPTS, max_new_tokens=8)


def test_the_client_holds_the_header_not_the_weights(cluster):
    """SmolLM2 (97 MB of packed weights) placed over both workers: read there, the client's
    anonymous memory barely moves; sent, it grows by most of the model."""
    model = tfnb.load_model("smollm2", progress=False)
    before = _rss_anon_mb()
    read = tfnb.place(model, cluster.devices[:2], cluster)
    grown_read = _rss_anon_mb() - before
    assert set(read.weight_sources.values()) == {f"read {model.source}"}
    assert read.chat("What is the capital of France?", max_new_tokens=12) == \
        "The capital of France is Paris."
    assert grown_read < 20, f"client grew {grown_read:.0f} MB placing a 97 MB model"


def test_a_worker_reads_its_own_path(mixed_gguf, cluster, tmp_path):
    """``files=`` gives worker 1 a copy at another path: it reads that copy (shown by a copy
    whose last block's bytes differ from the client's file, same size and header: worker 1's
    stages then compute with them)."""
    model = tfnb.load_model(mixed_gguf, progress=False)
    devices = {"embed": cluster.devices[0], "block.0": cluster.devices[0],
               "block.1": cluster.devices[0], "block.2": cluster.devices[1],
               "head": cluster.devices[1]}
    sent = tfnb.place(model, devices, cluster, files=False)
    copy = tmp_path / "copy.gguf"
    shutil.copy(mixed_gguf, copy)
    same = tfnb.place(model, devices, cluster, files={"worker:1": copy})
    assert same.weight_sources == {"worker:0": f"read {mixed_gguf}", "worker:1": f"read {copy}"}
    assert np.array_equal(same.logits(PROMPTS[0]), sent.logits(PROMPTS[0]))
    down = model.weights["blocks.2.w_down"].parts[0]
    with open(copy, "r+b") as f:  # other codes in block 2's down matrix (still valid blocks)
        f.seek(down.offset + 2)
        f.write(bytes(255 - b for b in f.read(16)))
    other = tfnb.place(model, devices, cluster, files={"worker:1": str(copy)})
    assert not np.allclose(other.logits(PROMPTS[0]), sent.logits(PROMPTS[0]))
    # what was placed before holds its own copy of the rows: the file's change left it alone
    assert np.array_equal(same.logits(PROMPTS[0]), sent.logits(PROMPTS[0]))


def test_a_different_or_missing_file_is_refused_before_anything_is_placed(mixed_gguf, cluster,
                                                                          tmp_path):
    model = tfnb.load_model(mixed_gguf, progress=False)
    size = os.path.getsize(mixed_gguf)
    longer = tmp_path / "longer.gguf"
    longer.write_bytes(mixed_gguf.read_bytes() + b"\0")
    with pytest.raises(PlacementError, match=rf"worker:1's '{longer}' has {size + 1} bytes where "
                       rf"this process's '{mixed_gguf}' has {size}: expected the same GGUF"):
        tfnb.place(model, cluster.devices[:2], cluster, files={"worker:1": longer})
    shorter = tmp_path / "shorter.gguf"
    shorter.write_bytes(mixed_gguf.read_bytes()[:-7])
    with pytest.raises(PlacementError, match=rf"has {size - 7} bytes where"):
        tfnb.place(model, cluster.devices[:2], cluster, files={"worker:0": shorter})
    renamed = tmp_path / "renamed.gguf"  # same size, one byte of the header's name changed
    data = bytearray(mixed_gguf.read_bytes())
    at = data.index(b"tiny")
    data[at] = ord("T")
    renamed.write_bytes(bytes(data))
    with pytest.raises(PlacementError, match=r"worker:1's .* has the same size .* but another "
                       r"header or tensor table \(fingerprint [0-9a-f]{16} against"):
        tfnb.place(model, cluster.devices[:2], cluster, files={"worker:1": renamed})
    with pytest.raises(PlacementError, match=r"worker:1 cannot read '/nowhere/m.gguf' "
                       r"\(NotFoundError\): expected the model's file there, or "
                       r"files=\{'worker:1': None\}"):
        tfnb.place(model, cluster.devices[:2], cluster, files={"worker:1": "/nowhere/m.gguf"})
    with pytest.raises(PlacementError, match=r"files='push': expected None .*, False .* or a "
                       "dict"):
        tfnb.place(model, cluster.devices[:2], cluster, files="push")
    with pytest.raises(PlacementError, match=r"files key 'worker:7' names no worker of the "
                       r"cluster: expected one of \['worker:0', 'worker:1'\]"):
        tfnb.place(model, cluster.devices[:2], cluster, files={"worker:7": longer})
    with pytest.raises(PlacementError, match=r"files\['worker:1'\]=3: expected a path or None"):
        tfnb.place(model, cluster.devices[:2], cluster, files={"worker:1": 3})
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(PlacementError, match=rf"worker:0 cannot read '{folder}' \("):
        tfnb.place(model, cluster.devices[:2], cluster, files={"worker:0": folder})
    # the refusals left the workers as they were: a placement runs as before
    placed = tfnb.place(model, cluster.devices[:2], cluster)
    assert len(placed.generate_ids(PROMPTS[0], max_new_tokens=4)) == 4


def test_checking_a_file_fails_no_call_of_another_thread(mixed_gguf, cluster):
    """The file check's length test fails on purpose on the worker. A placement on that worker
    made meanwhile (a copy placed again while the others serve) must not see that error: a
    request thread generates there while another thread checks the file again and again.
    (With the check on the executor threads share, most of the other thread's calls failed
    with "Readonly memory region has wrong length".)"""
    import threading

    model = tfnb.load_model(mixed_gguf, progress=False)
    placed = tfnb.place(model, cluster.devices[:1], cluster)
    want = placed.generate_ids(PROMPTS[0], max_new_tokens=4)
    loader = fileload.WeightLoader(model.weights, cluster.devices[:1])
    stop, checks = threading.Event(), [0]

    def check():
        while not stop.is_set():
            loader.check(timeout=30)
            checks[0] += 1

    checker = threading.Thread(target=check, daemon=True)
    checker.start()
    try:
        got = [placed.generate_ids(PROMPTS[0], max_new_tokens=4) for _ in range(12)]
    finally:
        stop.set()
        checker.join(60)
    assert checks[0] >= 3, checks  # the check ran beside the calls
    assert got == [want] * 12


def test_a_worker_without_the_file_is_sent_its_weights_with_progress(mixed_gguf, cluster,
                                                                     monkeypatch):
    monkeypatch.setattr(fileload, "SHOW_SENDS_FROM", 0)  # a bar even for a tiny model
    model = tfnb.load_model(mixed_gguf, progress=False)
    seen = []
    placed = tfnb.place(model, cluster.devices[:2], cluster, files={"worker:1": None},
                        progress=lambda done, total, what: seen.append((done, total, what)))
    assert placed.weight_sources == {"worker:0": f"read {mixed_gguf}",
                                     "worker:1": "sent from the client"}
    assert {what for _, _, what in seen} == {"sending to worker:1", "sending to worker:0"}
    mine = [(d, t) for d, t, what in seen if what == "sending to worker:1"]
    assert mine[-1][0] == mine[-1][1] > 10_000  # its packed weights, every byte
    assert all(a[0] <= b[0] for a, b in zip(mine, mine[1:]))
    assert max(d for d, _, w in seen if w == "sending to worker:0") < 5_000  # norms only
