"""The demo and the CLI end without TensorFlow's log noise; the filter keeps everything else."""
import os
import subprocess
import sys

from tfnb.cluster.tflog import NoiseFilter

# What `tfnb demo` printed to stderr before (TF 2.21, no GPU): start-up probing, absl's pre-init
# notice, and one block per tf.function and worker at exit.
NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "cudart_stub.cc", "cuda_platform.cc", "failed call to cuInit", "oneDNN custom operations",
    "cpu_feature_guard.cc", "Failed to remove function remotely", "EagerService/Enqueue",
    "Connection refused",
]

_TINY_TEARDOWN = """
import warnings, tfnb
from tfnb.models import tiny
warnings.simplefilter("ignore")
c = tfnb.local(2)
placed = tfnb.place(tiny("llama"), c.devices, c, timeout=60.0)
placed.eos_ids = ()
assert len(placed.generate_ids("hello", max_new_tokens=4)) == 4
c.stop()  # workers gone while `placed` and its compiled functions are still alive
print("done", flush=True)
"""


def _noise_in(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if any(n in ln for n in NOISE)]


def test_exit_after_stopping_the_workers_logs_no_failed_remote_cleanup():
    # No stderr filter here: the order of shutdown alone must keep TF from logging a failed
    # remote removal for every function at exit (it did: 4 lines per function and worker).
    res = subprocess.run([sys.executable, "-c", _TINY_TEARDOWN], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0 and res.stdout.strip().endswith("done"), res.stderr[-3000:]
    assert not [ln for ln in res.stderr.splitlines() if "remotely" in ln or "Enqueue" in ln], \
        res.stderr[-3000:]


def test_tiny_demo_through_the_cli_has_a_clean_stderr(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    res = subprocess.run([sys.executable, "-m", "tfnb.cli", "demo", "--model", "tiny",
                          "--notebook", "", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True,
                         timeout=400, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "== done" in res.stdout and (tmp_path / "out" / "profile.png").exists()
    assert _noise_in(res.stderr) == [], res.stderr[-3000:]
    assert res.stderr.strip() == "", res.stderr[-3000:]


def test_verbose_cli_keeps_tensorflow_logs(tmp_path):
    # The filter is on unless asked: with --verbose the worker's start-up probing reaches stderr.
    code = ("import sys; from tfnb.cli import main; sys.argv[0] = 'tfnb'; "
            "sys.exit(main(sys.argv[1:]))")
    port = _free_port()
    for flags, shown in ((["--verbose"], True), ([], False)):
        proc = subprocess.Popen([sys.executable, "-c", code, *flags, "worker", "--cluster",
                                 f"127.0.0.1:{port}", "--task", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
        try:
            assert proc.stdout.readline().startswith("TFNB_READY ")
            proc.terminate()
            _, err = proc.communicate(timeout=20)
        finally:
            proc.kill()
        assert bool(_noise_in(err)) == shown, err[-2000:]


def test_filter_drops_tf_noise_blocks_and_keeps_everything_else():
    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1796120597.518694    5821 cudart_stub.cc:31] "
        "Could not find cuda drivers on your machine.",
        "E0000 00:00:1796120600.060154    5821 cuda_platform.cc:52] "
        "failed call to cuInit: INTERNAL",
        "E0000 00:00:1796120607.906363    5821 context.cc:911] "
        "Failed to remove function remotely due to x",
        "Additional GRPC error information from remote target /job:worker/replica:0/task:0 while "
        "calling /tensorflow.eager.EagerService/Enqueue:",
        ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Connection refused"}',
        "This could happen if the remote target has been disconnected from the client.",
        "E0000 00:00:1796120609.1    5821 graph_execution_state.cc:1] a real error stays",
        "Traceback (most recent call last):",
        "tfnb.errors.WorkerLostError: worker 1 stopped answering",
        "This could happen if the remote target has been disconnected from the client.",
    ]
    f = NoiseFilter()
    kept = [ln for ln in lines if f.keep(ln + "\n")]
    assert kept == lines[7:]  # the last line is not inside a dropped block: kept


def _free_port():
    from tfnb.cluster.local import free_ports

    return free_ports(1)[0]
