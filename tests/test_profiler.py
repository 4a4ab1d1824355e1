"""tfnb.profiler against real TF workers: a known split whose transfer sizes are known exactly."""
import json
import socket
import time
import types

import pytest
from IPython.core.error import UsageError

import tfnb
import tfnb.profiler  # tfnb/__init__.py does not (yet) expose the subpackage lazily
from tfnb.errors import ProfileError

B, H = 4, 96  # batch and hidden size of the known split: each boundary moves B*H*4 bytes


def known_split(cluster):
    """x on worker 0 -> matmul -> worker 1 -> matmul -> back to worker 0, inside a tf.function."""
    import tensorflow as tf

    w0, w1 = (f"{w}/device:CPU:0" for w in cluster.workers)
    with tf.device(w0):
        k0 = tf.Variable(tf.random.normal([H, H]), name="k0")
        x_BxH = tf.identity(tf.ones([B, H]))
    with tf.device(w1):
        k1 = tf.Variable(tf.random.normal([H, H]), name="k1")

    @tf.function
    def chain(x_BxH):
        with tf.device(w0):
            h_BxH = tf.matmul(x_BxH, k0)
        with tf.device(w1):
            y_BxH = tf.nn.relu(tf.matmul(h_BxH, k1))
        with tf.device(w0):
            return y_BxH + 1.0

    chain(x_BxH).numpy()  # trace and place outside the profiled block
    return types.SimpleNamespace(chain=chain, x=x_BxH, w0=w0, w1=w1, vars=(k0, k1))


@pytest.fixture
def split(cluster):
    return known_split(cluster)


def _with_targets(cluster, extra: dict):
    """The connected cluster as the profiler sees it, plus ``extra`` {task: address} targets."""
    return types.SimpleNamespace(
        workers=cluster.workers + list(extra), connected=True,
        client_address=cluster.client_address,
        spec=types.SimpleNamespace(addresses=cluster.spec.addresses + list(extra.values())))


def test_known_split_bytes_busy_and_steps(split):
    t0 = time.perf_counter()
    with tfnb.profiler.profile(timeout=30) as prof:
        for _ in range(3):
            z = split.chain(split.x)
    measured_ms = (time.perf_counter() - t0) * 1e3
    assert z.shape == (B, H)
    assert not prof.partial, prof.reasons
    assert 0 < prof.wall_ms <= measured_ms

    per_call = {(r["source"], r["destination"]): r for r in prof.transfers(split.chain)}
    for edge in ((split.w0, split.w1), (split.w1, split.w0)):
        r = per_call[edge]
        assert r["calls"] == 3 and r["count_per_call"] == 1 and r["unknown"] == 0
        assert r["bytes_per_call"] == pytest.approx(B * H * 4, rel=0.01)
    devs, nbytes, count = prof.transfer_matrix()
    assert nbytes[devs.index(split.w0)][devs.index(split.w1)] == 3 * B * H * 4
    assert count[devs.index(split.w1)][devs.index(split.w0)] == 3

    busy = {r["device"]: r for r in prof.busy()}
    for dev in (split.w0, split.w1):
        r = busy[dev]
        assert 0 < r["compute_ms"] and 0 < r["busy_ms"] <= prof.wall_ms <= measured_ms
        assert r["compute_ms"] + r["send_recv_ms"] + r["idle_ms"] == pytest.approx(prof.wall_ms)
    steps = [s for s in prof.steps() if s["step"] in prof.calls(split.chain)]
    assert len(steps) == 3 and all({split.w0, split.w1} <= set(s["devices"]) for s in steps)
    assert all(0 <= s["start_ms"] < s["end_ms"] <= prof.wall_ms for s in steps)
    # the two matmuls and the two hops show up as such, whatever kernel library TF picked
    # (Eigen's "MatMul" or oneDNN's "_MklMatMul"/"_FusedMatMul")
    kinds = {r["kind"]: r for r in prof.top_ops(20, by="kind")}
    assert kinds["matmul"]["count"] >= 2 * 3 and kinds["transfer"]["count"] >= 2 * 3, kinds


@pytest.fixture(scope="module")
def tiny_llama():
    from tfnb.models import tiny

    return tiny("llama", seed=0)


@pytest.mark.parametrize("layout, boundaries", [("split", 1), ("alternating", 2)])
def test_llm_decode_loop_moves_one_activation_per_token_and_boundary(cluster, tiny_llama, layout,
                                                                     boundaries):
    """The runtime's decode chunks (unrolled steps calling one function per segment): per
    decode step, worker 0 -> worker 1 carries exactly the hidden state of each boundary, so
    no weight crosses; each edge is counted once per step."""
    w0, w1 = cluster.devices[:2]
    stages = {"split": {"embed": w0, "block.0": w0, "block.1": w1, "head": w1},
              "alternating": {"embed": w0, "block.0": w1, "block.1": w0, "head": w1}}[layout]
    placed = tfnb.place(tiny_llama, stages, cluster)
    placed.eos_ids = ()  # no row stops early (a batch drops rows that have ended)
    prompts = [[1, 60, 70, 80, 5], [1, 40, 41, 42, 43]]
    D, Bt = tiny_llama.config.hidden_size, len(prompts)
    placed.generate_ids(prompts, max_new_tokens=4)  # compile outside the profiled blocks

    def profiled(n):
        lane = placed.scheduler.lanes[0]
        before = lane.steps
        with tfnb.profiler.profile(cluster, timeout=30) as prof:
            out = placed.generate_ids(prompts, max_new_tokens=n)
        assert not prof.partial, prof.reasons
        # the decode steps run: the first token comes from prefill, and a chain's unrolled
        # chunks may run a step or two past the last one
        steps = lane.steps - before
        assert max(len(r) for r in out) - 1 <= steps <= max(len(r) for r in out) + 1
        rows = {(r["source"], r["destination"]): r for r in prof.transfers()}
        return prof, steps, rows

    (_, steps_a, a), (prof, steps_b, b) = profiled(6), profiled(20)
    assert 14 <= steps_b - steps_a <= 16
    assert all(s != d and s.startswith("/job:") and d.startswith("/job:") for s, d in b)
    for edge in ((w0, w1), (w1, w0)):
        assert a[edge]["unknown"] == b[edge]["unknown"] == 0, b[edge]
    per_token = (b[(w0, w1)]["bytes"] - a[(w0, w1)]["bytes"]) / (steps_b - steps_a)
    assert per_token == pytest.approx(D * 4 * Bt * boundaries, rel=0.01)
    back = (b[(w1, w0)]["bytes"] - a[(w1, w0)]["bytes"]) / (steps_b - steps_a)
    assert 0 < back - D * 4 * Bt * (boundaries - 1) < D * 4 * Bt  # plus the next tokens only
    # one transfer per boundary for the prefill and one per boundary and step, no more
    assert b[(w0, w1)]["count"] == (steps_b + 1) * boundaries, prof.transfer_edges()


def test_views_and_exports(split, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tfnb.profiler.profile() as prof:
        split.chain(split.x)
    stages = prof.stage_times({"first": split.w0, "second": split.w1},
                              predicted={"first": 1.0, "second": 2.0})
    assert [s["stage"] for s in stages] == ["first", "second"]
    assert all(s["measured_ms"] > 0 for s in stages)
    assert stages[1]["predicted_ms"] == 2.0
    for kind in ("summary", "busy", "timeline", "transfers", "top_ops"):
        assert prof.plot(kind).axes
    assert prof.plot("stages", plan={"first": split.w0}).axes
    html = prof._repr_html_()
    assert "data:image/png;base64," in html and "worker:1/CPU:0" in html
    assert html == prof._repr_html_()
    assert "worker:0/CPU:0 -> worker:1/CPU:0" in str(prof)
    prof.save(tmp_path / "p.png")
    prof.save(tmp_path / "p.svg", kind="timeline")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert b"<svg" in (tmp_path / "p.svg").read_bytes()
    run = tmp_path / "tb"
    files = list((run / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert not files
    prof.export_tensorboard(run)
    files = sorted(p.name for p in (run / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(files) == 3 and "client.xplane.pb" in files
    worker1 = next((run / "plugins" / "profile").glob("*/worker-r0-t1.xplane.pb"))
    space = xplane_pb2.XSpace.FromString(worker1.read_bytes())
    assert any(p.name == "/host:CPU" for p in space.planes)
    trace = json.loads((tmp_path / "t.json").read_text()
                       if prof.export_chrome_trace(tmp_path / "t.json") else "")
    sends = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["op"] == "_Send"]
    assert sends and all(e["dur"] >= 0 for e in sends)
    with pytest.raises(ProfileError, match="'x.pdf'"):
        prof.save("x.pdf")
    with pytest.raises(ProfileError, match="'nowhere'"):
        prof.stage_times({"s": "nowhere"})


def _silent_server():
    """Accepts TCP connections and never answers (a hung worker)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def test_dead_silent_and_unprofiled_workers_give_a_partial_profile(cluster):
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from tfnb.cluster.local import free_ports

    silent = _silent_server()
    bare = grpc.server(ThreadPoolExecutor(1))  # a gRPC server without the profiler service
    bare_port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    extra = {"/job:gone/replica:0/task:0": dead,
             "/job:hung/replica:0/task:0": f"127.0.0.1:{silent.getsockname()[1]}",
             "/job:bare/replica:0/task:0": f"127.0.0.1:{bare_port}"}
    view = _with_targets(cluster, extra)
    try:
        t0 = time.monotonic()
        with tfnb.profiler.profile(view, timeout=2) as prof:
            pass
        assert time.monotonic() - t0 < 30  # bounded by the timeout, not a hang
    finally:
        silent.close()
        bare.stop(0)
    assert prof.partial and set(prof.reasons) == set(extra)
    gone = prof.reasons["/job:gone/replica:0/task:0"]
    assert dead in gone and "dead or unreachable" in gone
    assert "did not answer within" in prof.reasons["/job:hung/replica:0/task:0"]
    assert "no TF profiler service" in prof.reasons["/job:bare/replica:0/task:0"]
    assert "PARTIAL" in repr(prof) and "not traced" in prof._repr_html_()
    assert {f"{w}/device:CPU:0" for w in cluster.workers} <= set(prof.devices)


def _fake_profiler(snapshot):
    """A gRPC server whose ProfilerService starts sessions at once and answers GetSnapshot with
    ``snapshot(request, context)``; returns (server, port)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from tfnb.profiler.rpc import messages

    m = messages()

    def rpc(fn, req):
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=m[req].FromString,
            response_serializer=lambda msg: msg.SerializeToString())

    server = grpc.server(ThreadPoolExecutor(4))
    handlers = {"StartContinuousProfiling": rpc(lambda req, ctx: m["Empty"](), "ProfileRequest"),
                "StopContinuousProfiling": rpc(lambda req, ctx: m["Empty"](), "Empty"),
                "GetSnapshot": rpc(snapshot, "Empty")}
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("tensorflow.ProfilerService", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_worker_dying_or_hanging_while_its_trace_comes_in_gives_a_partial_profile(cluster):
    """Leaving the block only ends the trace window; a worker that dies or hangs while its trace
    is on its way makes the profile partial when it is read, within the timeout, never a hang."""
    import threading

    from tfnb.profiler.rpc import messages

    release = threading.Event()

    def hang(req, ctx):
        release.wait(30)
        return messages()["ProfileResponse"]()

    (dying, dying_port), (hung, hung_port) = _fake_profiler(hang), _fake_profiler(hang)
    extra = {"/job:dies/replica:0/task:0": f"127.0.0.1:{dying_port}",
             "/job:hangs/replica:0/task:0": f"127.0.0.1:{hung_port}"}
    view = _with_targets(cluster, extra)
    try:
        t0 = time.monotonic()
        with tfnb.profiler.profile(view, timeout=3) as prof:
            pass
        assert time.monotonic() - t0 < 2  # did not wait for the traces (the hung one takes 3 s)
        dying.stop(0)  # dies with its GetSnapshot in flight
        t1 = time.monotonic()
        reasons = prof.reasons
        assert time.monotonic() - t1 < 3 + 2  # bounded by the timeout
    finally:
        release.set()
        dying.stop(0)
        hung.stop(0)
    assert prof.partial and set(reasons) == set(extra), reasons
    died = reasons["/job:dies/replica:0/task:0"]
    assert extra["/job:dies/replica:0/task:0"] in died
    assert "went away" in died or "dead or unreachable" in died
    assert "did not answer within the capture timeout" in reasons["/job:hangs/replica:0/task:0"]
    assert {f"{w}/device:CPU:0" for w in cluster.workers} <= set(prof.devices)


def test_back_to_back_blocks_read_later(split):
    """A block can start while the previous one's traces are still coming in; each profile
    holds its own block only."""
    profs = []
    for _ in range(3):
        with tfnb.profiler.profile(timeout=30) as prof:
            split.chain(split.x)
        profs.append(prof)
    for prof in profs:
        assert not prof.partial, prof.reasons
        assert [r["calls"] for r in prof.transfers(split.chain)] == [1, 1]


def test_not_connected_and_bad_arguments(cluster, ipython):
    with pytest.raises(ProfileError, match="timeout=0"):
        with tfnb.profiler.profile(timeout=0):
            pass
    cluster.disconnect()
    with pytest.raises(ProfileError, match="not connected"):
        with tfnb.profiler.profile():
            pass
    res = ipython.run_cell("%%tfprofile\nx = 1\n", store_history=False)
    assert isinstance(res.error_in_exec, UsageError) and "not connected" in str(res.error_in_exec)
    prof = tfnb.profiler.Profile()
    with pytest.raises(ProfileError, match="still running"):
        prof.busy()


@pytest.mark.parametrize("cell, needle", [
    ("%%tfprofile\n", "empty"), ("%%tfprofile\n   \n", "empty"),
    ("%%tfprofile --timeout 0\nx = 1\n", "timeout=0"),
    ("%%tfprofile --timeout 99999\nx = 1\n", "99999"),
    ("%%tfprofile -o 1x\nx = 1\n", "'1x'"), ("%%tfprofile --frobnicate\nx = 1\n", "--frobnicate"),
    ("%%tfprofile --timeout abc\nx = 1\n", "'abc'"),
])
def test_magic_bad_input_is_one_usage_line(ipython, cell, needle):
    res = ipython.run_cell(cell, store_history=False)
    assert isinstance(res.error_in_exec, UsageError) and needle in str(res.error_in_exec)


def test_magic_stores_profile_and_stops_capture_when_the_cell_fails(ipython, split, tmp_path):
    ipython.user_ns.update(chain=split.chain, x=split.x)
    assert "tfprofile" in ipython.magics_manager.magics["cell"]
    res = ipython.run_cell(f"%%tfprofile -o p --timeout 30 --trace-dir {tmp_path}\nz = chain(x)\n",
                           store_history=False)
    assert res.error_in_exec is None and isinstance(res.result, tfnb.profiler.Profile)
    p = ipython.user_ns["p"]
    assert p is res.result and ipython.user_ns["z"].shape == (B, H)
    assert {r["bytes_per_call"] for r in p.transfers(split.chain)} == {B * H * 4}
    assert list(tmp_path.glob("plugins/profile/*/client.xplane.pb"))
    res = ipython.run_cell("%%tfprofile -o p2\nz = chain(x)\nraise KeyError('boom')\n",
                           store_history=False)
    assert isinstance(res.error_in_exec, KeyError)
    assert ipython.user_ns["p2"].transfers(split.chain)[0]["calls"] == 1
    # nothing left running
    res = ipython.run_cell("%%tfprofile -o p3\nz = chain(x)\n", store_history=False)
    assert res.error_in_exec is None and not ipython.user_ns["p3"].partial


def test_parsing_helpers():
    from tfnb.profiler.profile import union_ns
    from tfnb.profiler.xplane import key_devices, parse_shapes, transfer_bytes

    assert parse_shapes("(float[8,64];int64[];half[?,3])") == [("float", [8, 64]), ("int64", []),
                                                               ("half", [None, 3])]
    assert parse_shapes("(int32[3];;)") == [("int32", [3]), (None, None), (None, None)]
    assert transfer_bytes("(float[1,1,576];int32[2];;;bool[1])", 0) == 2304
    assert transfer_bytes("(float[8,64];float[64,64])", 0) == 2048
    assert transfer_bytes("(float[8,64];float[64,64])", None) is None
    assert transfer_bytes("(double[2,2];double[2,2])", None) == 32
    assert union_ns([(0, 10), (5, 20), (30, 40), (35, 36)], 0, 38) == 28
    assert key_devices("/a;1;/b;edge_1_x;0:0") == ("/a", "/b")
    assert key_devices("/device:CPU:0;1;/device:CPU:0;x:0;0:0", "/job:w/replica:0/task:1") == \
        ("/job:w/replica:0/task:1/device:CPU:0",) * 2
    from tfnb.profiler.library import strip_inlined

    assert strip_inlined("while/body/_1/while/StatefulPartitionedCall_1") == \
        "while/StatefulPartitionedCall_1"
    assert strip_inlined("MatMul") == "MatMul"


@pytest.mark.parametrize("op, kind", [("MatMul", "matmul"), ("_MklMatMul", "matmul"),
                                      ("_FusedMatMul", "matmul"),
                                      ("BatchMatMulV2", "matmul"), ("_MklBatchMatMulV2", "matmul"),
                                      ("_Send", "transfer"), ("_Recv", "transfer"),
                                      ("StatefulPartitionedCall", "compiled"), ("Relu", "other")])
def test_op_kinds_do_not_depend_on_the_kernel_library(op, kind):
    from tfnb.profiler.xplane import op_kind

    assert op_kind(op) == kind
