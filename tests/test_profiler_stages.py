"""Inside the compiled stages: time per stage and op kind from XLA's own per-op events, and
each device's decode step against its memory-bandwidth bound (real workers, tfnb's runtime)."""
import pytest

import tfnb
import tfnb.profiler
from tfnb.errors import ProfileError

PROMPT = [1, 60, 70, 80, 5]


@pytest.fixture(scope="module")
def tiny_llama():
    from tfnb.models import tiny

    return tiny("llama", seed=0)


def _heavier_block(monkeypatch, stage: str, extra_matmuls: int = 24):
    """Make one block of the runtime's decode step do extra (real, input-dependent) matmuls
    whose result is added times zero: its tokens stay the same, its time grows."""
    import tensorflow as tf

    from tfnb.runtime import forward as L
    from tfnb.runtime import graphs

    plain = L.block_decode

    def block_decode(x_Bx1xD, *args, **kwargs):
        out = plain(x_Bx1xD, *args, **kwargs)
        if tf.get_current_name_scope().split("/")[-1] != stage:
            return out
        x_NxD = tf.reshape(x_Bx1xD, [-1, x_Bx1xD.shape[-1]])
        z_DxD = tf.matmul(x_NxD, x_NxD, transpose_a=True)
        for _ in range(extra_matmuls):
            z_DxD = tf.tanh(tf.matmul(z_DxD, z_DxD))
        return out + 0.0 * tf.reduce_sum(z_DxD)

    monkeypatch.setattr(L, "block_decode", block_decode)
    # segments' traces are shared by every placement of the same segment: this test's
    # placements trace the heavier block into a table of their own, dropped with the patch
    monkeypatch.setattr(graphs, "_shared", type(graphs._shared)())


def _profiled(cluster, placed, n=24):
    placed.generate_ids([PROMPT], max_new_tokens=4)  # compile outside the profiled block
    lane = placed.scheduler.lanes[0]
    before = lane.steps
    with tfnb.profiler.profile(cluster, timeout=30) as prof:
        out = placed.generate_ids([PROMPT], max_new_tokens=n)
    assert not prof.partial, prof.reasons
    # the decode steps the devices ran: a chain's unrolled chunks may run past the last token
    steps = lane.steps - before
    assert len(out[0]) - 1 <= steps <= len(out[0]) + 2  # the first token comes from prefill
    return prof, out, steps


def test_the_deliberately_heavier_block_is_the_slowest_stage(cluster, tiny_llama, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    w0, w1 = cluster.devices[:2]
    plan = tfnb.Plan.from_assignment(tiny_llama.chain,
                                     {"embed": w0, "block.0": w0, "block.1": w1, "head": w1},
                                     tfnb.placement.Topology([w0, w1]), context_len=64)
    plain = tfnb.place(tiny_llama, plan, cluster)
    plain.eos_ids = ()
    want = plain.generate_ids([PROMPT], max_new_tokens=24)
    _heavier_block(monkeypatch, "block.1")
    heavy = tfnb.place(tiny_llama, plan, cluster)
    heavy.eos_ids = ()
    prof, got, steps = _profiled(cluster, heavy)
    assert got == want  # the extra work does not change a token

    rows = prof.stage_times(heavy)
    assert [r["stage"] for r in rows] == ["embed", "block.0", "block.1", "head"]
    by = {r["stage"]: r for r in rows}
    assert by["block.0"]["device"] == w0 and by["block.1"]["device"] == w1
    assert by["block.0"]["steps"] == by["block.1"]["steps"] == by["head"]["steps"] == steps
    assert by["block.1"]["ms_per_step"] > 2 * by["block.0"]["ms_per_step"], rows
    assert next(iter(by["block.1"]["step_kinds"])) == "matmul"  # its extra work is matmuls
    for r in rows:  # a step's kinds add up to the step (prefill not counted in)
        if r["steps"]:
            assert sum(r["step_kinds"].values()) == pytest.approx(r["ms_per_step"])
            assert r["decode_ms"] < r["measured_ms"]
    assert all(r["predicted_ms"] == pytest.approx(plan.prediction.stage_s[r["stage"]] * 1e3)
               for r in rows)
    # the runtime's own op kinds are told apart
    kinds = {k for r in rows for k in r["kinds"]}
    assert {"matmul", "attention", "norm", "rope", "sampling", "copies"} <= kinds, kinds
    per_device = {(r["device"], r["kind"]) for r in prof.op_kinds()}
    assert (w1, "sampling") in per_device and (w0, "sampling") not in per_device

    fig = prof.plot("stages", plan=heavy)
    assert "slowest stage: block.1" in fig.axes[0].get_title()
    assert "slowest stage: block.1 on worker:1/CPU:0" in str(prof)
    assert "slowest stage: block.1" in prof.plot().axes[3].get_title()  # the summary shows it too


def test_each_device_against_its_memory_bandwidth_bound(cluster, tiny_llama):
    w0, w1 = cluster.devices[:2]
    placed = tfnb.place(tiny_llama, {"embed": w0, "block.0": w0, "block.1": w1, "head": w1},
                        cluster)
    placed.eos_ids = ()
    prof, got, steps = _profiled(cluster, placed)
    cfg = tiny_llama.config

    b = prof.bound(bandwidth=1e9)  # a given bandwidth: the bound is bytes / 1 GB/s
    rows = {r["device"]: r for r in b["devices"]}
    assert set(rows) == {w0, w1}
    weights = {d: sum(v.shape.num_elements() * v.dtype.size for v in placed.variables
                      if v.device == d) for d in (w0, w1)}
    for dev, r in rows.items():
        assert r["weights_bytes"] == weights[dev] > 0
        # one block per worker, one row, attending a window of 64 slots (the bucket)
        assert r["kv_bytes"] == 64 * 2 * cfg.n_kv_heads * cfg.head_dim * 4
        assert r["bound_ms"] == pytest.approx((r["weights_bytes"] + r["kv_bytes"]) / 1e9 * 1e3)
        assert r["fraction"] == pytest.approx(r["bound_ms"] / r["ms_per_step"])
        assert r["ms_per_step"] > 0
    hop = {(r["source"], r["destination"]): r for r in b["links"]}[(w0, w1)]
    hidden = cfg.hidden_size * 4  # one hidden state per step, plus the (padded) prompt's once
    states = hop["bytes_per_step"] * steps / hidden
    assert states == pytest.approx(round(states)) and len(PROMPT) <= round(states) - steps <= 64
    assert hop["rtt_ms"] is not None and 0 < hop["rtt_ms"] < 100

    measured = prof.bound(links=False)["devices"]  # measured bandwidth, once per cluster
    assert all(0.2e9 < r["bandwidth"] < 2e12 and 0 < r["fraction"] for r in measured), measured
    text = str(prof)
    assert "worker:0/CPU:0: " in text and "of its memory-bandwidth bound" in text
    assert prof.plot("bound").axes


def test_compiled_ops_named_by_scope_even_where_xla_drops_the_metadata():
    """An einsum becomes dots without metadata in XLA's passes (TF 2.21); they still count to
    the stage and kind of the ops that use them."""
    import tensorflow as tf
    from tensorflow.compiler.xla.service import hlo_pb2

    from tfnb.profiler.xplane import compiled_ops

    @tf.function(jit_compile=True)
    def f(q, k, w):
        with tf.name_scope("block.3"):
            with tf.name_scope("attention"):
                s = tf.nn.softmax(tf.einsum("bhe,bse->bhs", q, k), axis=-1)
            return tf.matmul(tf.reshape(s, [2, -1]), w)

    args = (tf.ones([2, 4, 8]), tf.ones([2, 16, 8]), tf.ones([64, 32]))
    module = hlo_pb2.HloModuleProto.FromString(
        f.experimental_get_compiler_ir(*args)(stage="optimized_hlo_serialized"))
    ops = compiled_ops(hlo_pb2.HloProto(hlo_module=module).SerializeToString())
    assert ops and {op.stage for op in ops.values()} == {"block.3"}
    kinds = {op.kind for op in ops.values()}
    assert {"attention", "matmul"} <= kinds, ops


def test_a_profile_of_other_code_says_there_are_no_stages(cluster):
    import tensorflow as tf

    w0 = cluster.devices[0]

    @tf.function
    def plain(x):
        with tf.device(w0):
            return tf.matmul(x, x)

    x = tf.ones([8, 8])
    plain(x)
    with tfnb.profiler.profile(cluster, timeout=30) as prof:
        plain(x)
    assert not prof.compiled_stages() and prof.headline() == []
    with pytest.raises(ProfileError, match="no compiled op of a tfnb stage"):
        prof.stage_times()
    with pytest.raises(ProfileError, match=r"plot\('stages'\)"):
        prof.plot("stages")
    with pytest.raises(ProfileError, match="plan="):
        prof.stage_times(plan=42)
    assert prof.bound()["devices"] == []


def test_a_call_that_compiles_reports_its_compile_apart_from_its_run(cluster, tiny_llama,
                                                                     monkeypatch):
    from tfnb.runtime import graphs

    monkeypatch.setattr(graphs, "_shared", type(graphs._shared)())  # nothing compiled yet
    w0, w1 = cluster.devices[:2]
    placed = tfnb.place(tiny_llama, {"embed": w0, "block.0": w0, "block.1": w1, "head": w1},
                        cluster)
    placed.eos_ids = ()
    with tfnb.profiler.profile(cluster, timeout=60) as first:  # compiles every segment
        placed.generate_ids([PROMPT], max_new_tokens=6)
    with tfnb.profiler.profile(cluster, timeout=30) as again:  # runs what is compiled
        placed.generate_ids([PROMPT], max_new_tokens=6)
    compiled = {r["device"]: r for r in first.compiles()}
    assert set(compiled) == {w0, w1}
    assert all(r["count"] >= 2 and r["compile_ms"] > 5 for r in compiled.values())
    assert again.compiles() == []
    busy = {r["device"]: r for r in first.busy()}
    for dev in (w0, w1):
        r = busy[dev]
        assert r["compile_ms"] == pytest.approx(compiled[dev]["compile_ms"], rel=0.05)
        total = r["compute_ms"] + r["compile_ms"] + r["send_recv_ms"] + r["idle_ms"]
        assert total == pytest.approx(first.wall_ms)
        # the run itself costs about what it costs once compiled, not the compile
        assert r["compute_ms"] < r["compile_ms"]
    assert first.stage_times()  # the run's compiled ops still count to their stages
    assert "compiled: worker:0/CPU:0" in str(first) and "compiled:" not in str(again)
