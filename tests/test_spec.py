"""Cluster descriptions: every accepted form parses the same way; bad ones give one clear error."""
import gc
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfnb.cluster.probe import decode_status
from tfnb.cluster.spec import ClusterSpec, parse_address, parse_spec
from tfnb.errors import SpecError

TWO = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


def test_every_form_gives_the_same_spec(tmp_path, monkeypatch):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(TWO))
    monkeypatch.setenv("TF_CONFIG",
                       json.dumps({"cluster": TWO, "task": {"type": "worker", "index": 0}}))
    import tensorflow as tf

    forms = ["127.0.0.1:2222,127.0.0.1:2223", " 127.0.0.1:2222 , 127.0.0.1:2223 ", TWO,
             json.dumps(TWO), str(path), path, ["127.0.0.1:2222", "127.0.0.1:2223"],
             {"worker": {1: "127.0.0.1:2223", 0: "127.0.0.1:2222"}}, tf.train.ClusterSpec(TWO),
             tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(TWO))]
    for form in forms:
        assert parse_spec(form).as_dict() == TWO, form
    assert parse_spec(tf_config=True).as_dict() == TWO
    assert parse_spec(tf.distribute.cluster_resolver.TFConfigClusterResolver()).as_dict() == TWO


def test_slurm_resolver(monkeypatch):
    """TF's Slurm resolver, fed the variables Slurm sets for a 2-node job."""
    import tensorflow as tf

    for k, v in {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
                 "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                 "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_JOB_NODELIST": "node[1-2]",
                 "CUDA_VISIBLE_DEVICES": ""}.items():
        monkeypatch.setenv(k, v)
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=2222, gpus_per_node=1)
    assert parse_spec(resolver).as_dict() == {"worker": ["node1:2222", "node2:2222"]}


def test_spec_views():
    spec = ClusterSpec.parse({"worker": ["a:1", "b:2"], "ps": ["c:3"]})
    assert spec.tasks() == [("worker", 0, "a:1"), ("worker", 1, "b:2"), ("ps", 0, "c:3")]
    assert spec.device_prefix("c:3") == "/job:ps/replica:0/task:0"
    assert repr(spec) == "ClusterSpec(worker=['a:1', 'b:2'], ps=['c:3'])"
    assert parse_address("[::1]:2222") == "[::1]:2222"


@pytest.mark.parametrize("bad, words", [
    ("", "empty"),
    ("127.0.0.1", "no port"),
    ("127.0.0.1:0", "port '0'"),
    ("127.0.0.1:99999", "port '99999'"),
    ("host_name:22", "invalid host"),
    ("::1:22", "brackets"),
    ("a:1,a:1", "appears twice"),
    ({"worker": []}, "non-empty list"),
    ({"Worker!": ["a:1"]}, "job name"),
    ({}, "no jobs"),
    ('{"worker": ', "looks like JSON"),
    (42, "not understood"),
    ({"worker": {0: "a:1", 2: "b:2"}}, "0..n-1"),
])
def test_bad_specs_name_the_value(bad, words):
    with pytest.raises(SpecError) as e:
        parse_spec(bad)
    assert words in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files_and_tf_config(tmp_path, monkeypatch):
    with pytest.raises(SpecError, match="cannot be read"):
        parse_spec(str(tmp_path / "missing.json"))
    with pytest.raises(SpecError, match="cannot be read: a path holds no NUL byte"):
        parse_spec("/\x00")  # the fuzzer's find: the OS refuses it with a ValueError
    broken = tmp_path / "broken.json"
    broken.write_text('{"worker": ["a:1",')
    with pytest.raises(SpecError, match="not valid JSON"):
        parse_spec(broken)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(SpecError, match="TF_CONFIG is not set"):
        parse_spec(tf_config=True)
    monkeypatch.setenv("TF_CONFIG", '{"task": {}}')
    with pytest.raises(SpecError, match="no \"cluster\""):
        parse_spec(tf_config=True)


def test_status_decoding_of_a_real_payload():
    # GetStatusResponse bytes captured from a TF 2.21 worker.
    payload = (b'\nL\n)/job:worker/replica:0/task:0/device:CPU:0'
               b'\x12\x03CPU \x80\x80\x80\x80\x01*\x00'
               b'1\xe5\x1c\xb5\xdf\x12+\xb6\xc2@\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01')
    (dev,) = decode_status(payload)
    assert (dev.name, dev.device_type, dev.memory_limit, dev.short) == (
        "/job:worker/replica:0/task:0/device:CPU:0", "CPU", 268435456, "CPU:0")
    assert dev.incarnation == 0xC2B62B12DFB51CE5


spec_like = st.one_of(
    st.text(max_size=60),
    st.text(alphabet="0123456789.:,[]abc- {}\"", max_size=60),
    st.lists(st.text(max_size=20), max_size=4),
    st.dictionaries(st.text(max_size=8),
                    st.one_of(st.text(max_size=20), st.lists(st.text(max_size=20), max_size=3),
                              st.integers()),
                    max_size=3),
    st.integers(), st.none(), st.floats(allow_nan=True),
)


@settings(max_examples=400, deadline=None)
@given(spec_like)
def test_fuzzed_specs_give_clean_errors_fast(value):
    # this thread's CPU time, not the wall clock: a runaway parse (a backtracking regex) burns
    # CPU here, while a stall of the shared machine does not count (one CI run saw 3.2 s of
    # wall time for an example that parses in microseconds). The garbage collector is off
    # meanwhile: a full collection runs in the thread that allocates, and late in a CI run the
    # process holds millions of objects (one run saw 1.04 s of CPU for 'a692},.8.b', which
    # then parsed in microseconds; after importing TensorFlow alone a collection takes 0.1 s).
    gc.disable()
    try:
        start = time.thread_time()
        try:
            spec = parse_spec(value)
        except SpecError as e:
            assert str(e) and "\n" not in str(e)
        else:  # whatever was accepted is well-formed
            for _, _, address in spec.tasks():
                assert parse_address(address) == address
        assert time.thread_time() - start < 1.0
    finally:
        gc.enable()
