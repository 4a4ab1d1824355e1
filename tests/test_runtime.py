"""tfnb.runtime: placed llama generation on 1-3 logical CPU devices, checked against HF.

The tests need 3 logical CPU devices, which TF allows only before it initializes, and they must
not leak that setting into other test modules (or meet a cluster connection those made). So the
module runs itself in a fresh Python process (``test_runtime_in_fresh_process``); to run the
tests directly, set ``TFNB_TEST_RUNTIME_CHILD=1``.
"""
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

from tfnb.errors import GenerateError, PlacementError, WorkerLostError

_CHILD = os.environ.get("TFNB_TEST_RUNTIME_CHILD") == "1"


def _three_cpus() -> bool:
    try:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
    except RuntimeError:  # TF already initialized: keep whatever it has
        pass
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    return len(names) >= 3 and all("/job:" not in n or "localhost" in n for n in names)


HAVE_DEVICES = _CHILD and _three_cpus()
needs_devices = pytest.mark.skipif(
    not HAVE_DEVICES, reason="runs in a fresh process with 3 logical CPUs "
                             "(test_runtime_in_fresh_process)")


@pytest.mark.skipif(_CHILD, reason="this is the fresh process")
def test_runtime_in_fresh_process():
    env = dict(os.environ, TFNB_TEST_RUNTIME_CHILD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-x",
                           "-p", "no:cacheprovider"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_child_got_devices():
    if _CHILD:
        assert HAVE_DEVICES, "a fresh process could not make 3 logical CPU devices"


CPU = [f"/device:CPU:{i}" for i in range(3)]
PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 70, 80, 5, 9, 11, 12, 13, 14, 15, 16, 17, 18], [50, 51]]


@pytest.fixture(scope="module")
def model():
    from tfnb.models import tiny

    return tiny("llama", seed=0)


@pytest.fixture(scope="module")
def hf(model):
    return model.to_hf()


@pytest.fixture(scope="module")
def pm1(model):
    """One device, the whole decode loop in one XLA computation (the default there)."""
    from tfnb.runtime import place_llama as place

    return place(model, CPU[:1], xla_loop=True)


@pytest.fixture(scope="module")
def pm1_graph_loop(model):
    """One device, each decode step launched from a graph loop (``xla_loop=False``)."""
    from tfnb.runtime import place_llama as place

    return place(model, CPU[:1], xla_loop=False)


@pytest.fixture(scope="module")
def pm3(model):
    from tfnb.runtime import place_llama as place

    return place(model, CPU)


@pytest.fixture(scope="module")
def pm2(model):
    """Two devices, the head back on the embedding's device (a tied head shares its table)."""
    from tfnb.runtime import place_llama as place

    return place(model, {"embed": CPU[1], "block.0": CPU[1], "block.1": CPU[0], "head": CPU[1]})


def _hf_greedy(hf, ids, n):
    out = hf.generate(tf.constant([ids]), max_new_tokens=n, do_sample=False).numpy()[0]
    new = out[len(ids):].tolist()
    return new[:new.index(2) + 1] if 2 in new else new


@needs_devices
def test_greedy_tokens_match_hf_on_1_2_3_devices(hf, pm1, pm1_graph_loop, pm2, pm3):
    for ids in PROMPTS:
        want = _hf_greedy(hf, ids, 12)
        assert pm1.generate_ids(ids, max_new_tokens=12) == want
        assert pm1_graph_loop.generate_ids(ids, max_new_tokens=12) == want
        assert pm2.generate_ids(ids, max_new_tokens=12) == want
        assert pm3.generate_ids(ids, max_new_tokens=12) == want


@needs_devices
def test_logits_match_hf_within_1e4(hf, pm1, pm3):
    ids = PROMPTS[1]
    want = hf(tf.constant([ids])).logits.numpy()[0]
    for pm in (pm1, pm3):
        got = pm.logits(ids)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@needs_devices
def test_batch_of_different_lengths_equals_each_alone(pm3):
    texts = ["Hello", "Hi there, how", "Once upon a time in"]
    alone = [pm3.generate(t, max_new_tokens=10) for t in texts]
    assert pm3.generate(texts, max_new_tokens=10) == alone
    assert isinstance(alone[0], str) and all(alone)


@needs_devices
def test_seeded_sampling_is_reproducible_and_seed_dependent(pm3):
    kw = dict(max_new_tokens=16, do_sample=True, temperature=2.0)
    a = pm3.generate_ids(PROMPTS[1], seed=1, **kw)
    assert a == pm3.generate_ids(PROMPTS[1], seed=1, **kw)
    assert a == pm3.generate_ids(PROMPTS[1], seed=1, chunk_tokens=5, **kw)  # chunking-invariant
    assert a != pm3.generate_ids(PROMPTS[1], seed=2, **kw)
    greedy = pm3.generate_ids(PROMPTS[1], max_new_tokens=16)
    assert pm3.generate_ids(PROMPTS[1], seed=3, top_k=1, **kw) == greedy
    assert pm3.generate_ids(PROMPTS[1], seed=3, top_p=1e-6, **kw) == greedy


@needs_devices
def test_eos_ends_a_row_and_stop_strings_cut_the_text(pm1):
    ids = pm1.generate_ids(PROMPTS[0], max_new_tokens=30)
    assert ids[-1] == 2 and len(ids) < 30  # this prompt's greedy answer ends with EOS
    full = pm1.generate("Once upon a time", max_new_tokens=24)
    stop = full[10:12]
    cut = pm1.generate("Once upon a time", max_new_tokens=24, stop=stop)
    assert cut == full[:full.index(stop)]


@needs_devices
def test_streaming_chunks_add_up_and_report_progress(pm3):
    events = []
    full = pm3.generate("Once upon a time", max_new_tokens=20)
    pieces = list(pm3.generate("Once upon a time", max_new_tokens=20, stream=True,
                               chunk_tokens=6, on_chunk=events.append))
    assert "".join(pieces) == full
    assert len(pieces) == len(events) == 4
    assert [e.n_tokens for e in events] == [6, 12, 18, 20]
    assert events[-1].finished and events[-1].tokens_per_s > 0


@needs_devices
def test_chat_applies_the_template(model, pm1):
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert pm1.chat("Hi", max_new_tokens=8) == pm1.generate(prompt, max_new_tokens=8)


@needs_devices
def test_repeated_calls_in_one_bucket_do_not_retrace(pm3):
    pm3.generate("Hello", max_new_tokens=10)
    fns = [f for p in pm3._programs.values() for f in p.graphs.values()]
    counts = [f.experimental_get_tracing_count() for f in fns]
    pm3.generate("Hello you", max_new_tokens=12)  # same (batch, prompt, length) buckets
    assert [f.experimental_get_tracing_count() for f in fns] == counts


@needs_devices
def test_weights_and_caches_live_on_their_devices(pm2, pm3):
    for pm in (pm2, pm3):
        for seg, params in zip(pm.segments, pm.params):
            for block in params["blocks"]:
                for var in (v for v in block if v is not None):  # no q/k/v biases: None
                    assert tf.DeviceSpec.from_string(var.device).device_index == \
                        tf.DeviceSpec.from_string(seg.device).device_index
    assert [s.device for s in pm3.segments] == CPU
    assert [v.device.endswith("CPU:2") for v in pm3.params[-1].values()
            if isinstance(v, tf.Variable)] == [True, True]
    for seg, caches in zip(pm3.segments, next(iter(pm3._programs.values())).caches):
        assert all(k.device.endswith(seg.device[-5:]) for k, _ in caches)


@needs_devices
@pytest.mark.parametrize("kwargs, quoted", [
    (dict(prompts=""), "''"),
    (dict(prompts=5), "5"),
    (dict(prompts=[]), "[]"),
    (dict(prompts=["ok", 3]), "3"),
    (dict(prompts="x" * 256), "256 tokens"),
    (dict(prompts="x" * 200, max_new_tokens=100), "max_new_tokens=100"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3"),
    (dict(max_new_tokens=256), "max_new_tokens=256"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(top_k=2.0), "top_k=2.0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(seed="a"), "seed='a'"),
    (dict(stop=[""]), "stop=['']"),
    (dict(chunk_tokens=0), "chunk_tokens=0"),
])
def test_bad_generate_arguments_raise_generate_error(pm1, kwargs, quoted):
    kwargs = {"prompts": "Hello", **kwargs}
    with pytest.raises(GenerateError, match=None) as info:
        pm1.generate(**kwargs)
    assert quoted in str(info.value)


@needs_devices
def test_bad_stream_arguments_raise_at_the_call(pm1):
    with pytest.raises(GenerateError):
        pm1.generate("Hello", stream=True, top_p=2.0)  # not at the first next()


@needs_devices
def test_bad_assignments_raise_placement_error(model):
    from tfnb.runtime import place_llama as place

    full = {"embed": CPU[0], "block.0": CPU[0], "block.1": CPU[1], "head": CPU[1]}
    with pytest.raises(PlacementError, match="'head' has no device"):
        place(model, {k: v for k, v in full.items() if k != "head"})
    with pytest.raises(PlacementError, match="unknown stage 'block.7'"):
        place(model, {**full, "block.7": CPU[0]})
    with pytest.raises(PlacementError, match=r"'block.1'.*'/device:CPU:9' is not a logical"):
        place(model, {**full, "block.1": "/device:CPU:9"})
    with pytest.raises(PlacementError, match="GPU:0"):
        place(model, ["/device:GPU:0"])
    with pytest.raises(PlacementError, match="5 devices for 4 stages"):
        place(model, CPU + CPU[:2])


@needs_devices
def test_a_hung_call_raises_worker_lost_within_the_timeout(model, monkeypatch):
    from tfnb.runtime import place_llama as place

    pm = place(model, CPU[:2], timeout=0.3)
    pm.compile_timeout = None  # a first call may compile for longer; this one is not new
    from tfnb.runtime.graphs import Program

    monkeypatch.setattr(Program, "prefill_fn", lambda *a: (lambda *args: time.sleep(3)))
    start = time.perf_counter()
    with pytest.raises(WorkerLostError, match=r"no answer within 0.3 s.*CPU:0.*CPU:1"):
        pm.generate("Hello", max_new_tokens=4)
    assert time.perf_counter() - start < 2
    with pytest.raises(WorkerLostError, match="place it again"):
        pm.generate("Hello", max_new_tokens=4)


@needs_devices
def test_replace_moves_only_the_changed_stages(pm3):
    moved = pm3.replace({**pm3.assignment, "block.1": CPU[0]})
    assert moved.moved_stages == ["block.1"]
    assert moved.params[0]["blocks"][0] is pm3.params[0]["blocks"][0]   # block.0 stayed put
    assert moved.params[0]["blocks"][1].wqkv.device.endswith("CPU:0")
    assert moved.generate_ids(PROMPTS[0], max_new_tokens=6) == \
        pm3.generate_ids(PROMPTS[0], max_new_tokens=6)


@needs_devices
def test_lost_state_makes_generate_raise_worker_lost(model):
    from tfnb.runtime import place_llama as place

    pm = place(model, CPU[:1])
    pm.on_state_lost("worker task 0 restarted")
    with pytest.raises(WorkerLostError, match="task 0 restarted.*place it again"):
        pm.generate("Hello")


@needs_devices
def test_a_failing_worker_raises_worker_lost_naming_it(model, monkeypatch):
    from tfnb.runtime import place_llama as place

    pm = place(model, CPU[:2])
    pm.devices = ["/job:worker/replica:0/task:0/device:CPU:0",
                  "/job:worker/replica:0/task:1/device:CPU:0"]

    def fail(*args):
        raise tf.errors.UnavailableError(None, None, "Socket closed from /job:worker/replica:0/"
                                                     "task:1 while running")

    from tfnb.runtime.graphs import Program

    monkeypatch.setattr(Program, "prefill_fn", lambda *a: fail)
    with pytest.raises(WorkerLostError, match=r"\['/job:worker/replica:0/task:1/device:CPU:0'\]"):
        pm.generate("Hello", max_new_tokens=4)
