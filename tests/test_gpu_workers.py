"""GPU workers as far as a machine without a GPU can prove them: ``tfnb worker --gpu`` and
``tfnb.local(..., gpus=...)`` check what they are given and say plainly when TensorFlow sees no
GPU; ``--gpu none`` serves on the CPU; a GPU device takes the XLA route (the kernel is CPU
code). What needs a GPU itself is in ``benchmarks/gpu_check.py`` (docs/gpu.md)."""
import os
import subprocess
import sys

import pytest

import tfnb
from tfnb.errors import PlacementError, SpecError

GPU = "/job:worker/replica:0/task:0/device:GPU:0"


def sees_a_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def run_worker(*args):
    from tfnb.cluster.local import free_ports

    cmd = [sys.executable, "-m", "tfnb.cli", "worker", "--cluster",
           f"127.0.0.1:{free_ports(1)[0]}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


def test_a_worker_asked_for_a_gpu_tensorflow_cannot_see_says_so():
    if sees_a_gpu():
        pytest.skip("this machine has a GPU TensorFlow can use: the no-GPU message cannot show")
    done = run_worker("--gpu", "0")
    assert done.returncode == 2
    assert "--gpu 0: this TensorFlow sees no GPU" in done.stderr
    assert "tensorflow[and-cuda]" in done.stderr


def test_a_bad_gpu_value_is_one_clear_error():
    done = run_worker("--gpu", "first")
    assert done.returncode == 2
    assert "gpu='first': expected GPU indices such as '0' or '0,1'" in done.stderr


def test_local_checks_gpus_before_starting_anything():
    with pytest.raises(SpecError, match=r"gpus=\[0, 1\] has 2 entries for 3 workers"):
        tfnb.local(3, gpus=[0, 1])
    with pytest.raises(SpecError, match=r"gpu='x'"):
        tfnb.local(1, gpus=["x"])


def test_a_worker_with_gpu_none_serves_on_its_cpu():
    from tfnb.cluster import LocalCluster

    with LocalCluster(1, gpus="none") as lc:
        devices = lc.info[0]["devices"]
        assert any("CPU" in d for d in devices) and not any("GPU" in d for d in devices)


def test_a_gpu_device_takes_the_xla_route():
    """No probe is sent to a GPU device: the kernel is never a choice there."""
    from tfnb.runtime.weights import device_type, packed_routes

    assert device_type(GPU) == "GPU" and device_type("/gpu:1") == "GPU"
    assert device_type("/job:worker/replica:0/task:3") == "CPU"
    assert packed_routes([GPU]) == {GPU: "xla"}
    assert packed_routes([GPU], {"worker:0": "auto"}) == {GPU: "xla"}
    with pytest.raises(PlacementError, match="route 'kernel' on worker:0/GPU:0.*CPU code"):
        packed_routes([GPU], "kernel")
