"""Placement: cost model, planners (optimal proven against brute force), Plan files and views."""
import itertools
import json
import math
import os

import numpy as np
import pytest

from tfnb.errors import PlacementError
from tfnb.models import LayerChain, Stage, tiny
from tfnb.placement import (
    Plan,
    Topology,
    greedy_assignment,
    measure_topology,
    memory_assignment,
    plan,
    predict,
)
from tfnb.placement.cost import stage_memory
from tfnb.placement.optimal import optimal_segments

MB = 10**6


def random_chain(rng, n):
    kinds = ["embed"] + ["block"] * (n - 2) + ["head"] if n >= 2 else ["block"]
    stages = []
    for k, kind in enumerate(kinds):
        stages.append(Stage(f"s{k}", kind, int(rng.integers(1, 10)) * MB,
                            0 if kind == "embed" else int(rng.integers(1, 50)) * 10**6,
                            int(rng.choice([256, 4096, 10**6])), int(rng.integers(0, 3)) * 1000,
                            attn_flops_per_context=int(rng.integers(0, 1000))))
    return LayerChain(stages)


def random_topology(rng, n_dev, chain, identical=False):
    names = [f"d{i}" for i in range(n_dev)]
    need = sum(stage_memory(chain, 1, 16))
    memory = rng.uniform(0.3, 1.0, n_dev) * need
    flops = rng.choice([1e9, 2e9, 3e9, 4e9], n_dev)
    lat = rng.uniform(1e-5, 5e-3, (n_dev, n_dev))
    bw = rng.choice([1e8, 1e9, 1e10], (n_dev, n_dev))
    if identical:  # devices 0 and 1 interchangeable (all their figures and links equal)
        memory[1], flops[1] = memory[0], flops[0]
        lat[0, 1] = lat[1, 0]
        bw[0, 1] = bw[1, 0]
        for m in (lat, bw):
            m[1, 2:], m[2:, 1] = m[0, 2:], m[2:, 0]
    times = {}
    if rng.random() < 0.3:  # a measured stage time overrides the FLOP estimate
        times[(chain.names[-1], names[-1])] = float(rng.uniform(1e-4, 1e-1))
    return Topology(names, memory=[max(1, int(m)) for m in memory], flops=flops, latency=lat,
                    bandwidth=bw, stage_times=times)


def brute_force(chain, topo, objective, batch=1, context_len=16):
    """Best objective over every assignment where each device holds one contiguous run."""
    best = math.inf
    for combo in itertools.product(topo.devices, repeat=len(chain)):
        runs = [d for k, d in enumerate(combo) if k == 0 or combo[k - 1] != d]
        if len(runs) != len(set(runs)):
            continue  # a device revisited: outside the claim
        p = predict(chain, dict(zip(chain.names, combo)), topo, batch, context_len)
        if p.over_memory():
            continue
        best = min(best, p.latency_s if objective == "latency" else p.bottleneck_s)
    return best


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_optimal_matches_brute_force(objective):
    rng = np.random.default_rng(7 if objective == "latency" else 11)
    checked = infeasible = 0
    for trial in range(40):
        n, n_dev = int(rng.integers(2, 8)), int(rng.integers(1, 5))
        if n == 7 and n_dev == 4:
            n_dev = 3
        chain = random_chain(rng, n)
        topo = random_topology(rng, n_dev, chain, identical=n_dev >= 3 and trial % 2 == 0)
        expected = brute_force(chain, topo, objective)
        segs, found = optimal_segments(chain, topo, 1, 16, objective)
        if math.isinf(expected):
            assert segs is None
            try:  # no pipeline fits; a baseline that revisits a device may
                assert not plan(chain, topo, objective=objective,
                                context_len=16).prediction.over_memory()
            except PlacementError:
                pass
            infeasible += 1
            continue
        assert found == pytest.approx(expected, rel=1e-9), (trial, chain.names, topo)
        got = plan(chain, topo, objective=objective, context_len=16).prediction
        # throughput: a batch's share of a step, the busiest resource or the lanes' round
        value = got.latency_s if objective == "latency" else max(got.bottleneck_s, got.lane_s)
        search = predict(chain, {chain.names[k]: d for d, i, j in segs for k in range(i, j)},
                         topo, 1, 16)
        assert value <= (search.latency_s if objective == "latency" else
                         max(search.bottleneck_s, search.lane_s)) * (1 + 1e-9)
        if objective == "latency":
            assert value <= expected * (1 + 1e-9)   # the pipeline, or a baseline predicted better
        for mode, how in (("memory", "latency"), ("greedy", "latency"), ("optimal", "latency")):
            try:
                other = plan(chain, topo, mode=mode, objective=how, context_len=16).prediction
            except PlacementError:
                continue
            if objective == "throughput":  # never a slower rate than another planner's plan
                assert got.decode_throughput >= other.decode_throughput * (1 - 1e-9)
            elif mode != "optimal":
                assert value <= other.latency_s * (1 + 1e-9)
        assert not got.over_memory()
        checked += 1
    assert checked >= 25 and infeasible >= 1  # both outcomes were exercised


def test_equally_fast_splits_go_to_the_most_even_one():
    # Two equal devices, a chain too big for one: every split predicts the same latency, the
    # memory planner's fill-first split included. optimal/latency returns the split whose
    # slowest segment is fastest, which brute force confirms, without losing any latency.
    stages = [Stage("embed", "embed", 4 * MB, 0, 4096, 0)]
    stages += [Stage(f"b{k}", "block", 4 * MB, 10**7, 4096, 0) for k in range(8)]
    stages += [Stage("head", "head", 4 * MB, 4 * 10**7, 4096, 0)]
    chain = LayerChain(stages)
    topo = Topology(["a", "b"], memory=[32 * MB] * 2, flops=[1e9] * 2,
                    latency=np.array([[0, 1e-4], [1e-4, 0]]))
    plans = []
    for cut in range(1, len(chain)):
        a = {s: ("a" if k < cut else "b") for k, s in enumerate(chain.names)}
        p = predict(chain, a, topo, 1, 16)
        if not p.over_memory():
            plans.append(p)
    assert len(plans) >= 3  # several splits fit, at one latency
    fastest = min(p.latency_s for p in plans)
    assert all(p.latency_s == pytest.approx(fastest, rel=1e-12) for p in plans)
    got = plan(chain, topo, objective="latency", context_len=16).prediction
    fill = plan(chain, topo, mode="memory", context_len=16).prediction
    assert got.latency_s == pytest.approx(fastest, rel=1e-12)
    assert got.bottleneck_s == pytest.approx(min(p.bottleneck_s for p in plans), rel=1e-12)
    assert got.bottleneck_s < fill.bottleneck_s  # not the fill-first split it ties with


def test_interchangeable_devices_are_grouped():
    lat = np.array([[0, 1e-4, 1e-3], [1e-4, 0, 1e-3], [1e-3, 1e-3, 0]])
    topo = Topology(["a", "b", "c"], memory="1MB", latency=lat)
    assert topo.classes() == [[0, 1], [2]]
    assert Topology(["a", "b", "c"], memory=["1MB", "1MB", "2MB"]).classes() == [[0, 1], [2]]


@pytest.mark.parametrize("mode", ["optimal", "greedy", "memory", "replicate"])
def test_every_planner_respects_memory_including_kv(mode):
    chain = load_chain_like_smollm2()
    params = chain.total_param_bytes
    kv = sum(chain.kv_bytes(4, 2048).values())
    cap = params + kv // 2 if mode == "replicate" else (params + kv) // 3 + 20 * MB
    topo = Topology([f"d{i}" for i in range(4)], memory=cap, flops=[1e12, 2e12, 3e12, 4e12])
    if mode == "replicate":  # the weights alone fit, with the KV cache they do not: each
        # copy then runs over two devices, within their caps
        hybrid = plan(chain, topo, mode=mode, batch=4 * 4, context_len=2048)
        assert hybrid.replicas == (("d0", "d1"), ("d2", "d3"))
        assert max(hybrid.prediction.memory.values()) <= cap
        with pytest.raises(PlacementError, match="KV"):
            plan(chain, topo.with_max_memory(params // 3), mode=mode, batch=16,
                 context_len=2048)
        topo = topo.with_max_memory({d: params + kv for d in topo.devices})
    p = plan(chain, topo, mode=mode, batch=4, context_len=2048)
    for dev, used in p.prediction.memory.items():
        assert used <= p.prediction.capacity[dev]
    if mode != "replicate":  # the KV cache is counted where its stage is
        assert sum(p.prediction.memory.values()) == params + kv


def test_a_copy_too_large_for_one_device_replicates_as_pipelines_over_device_pairs(tmp_path):
    """A hybrid plan: each copy a pipeline over two consecutive devices, cut as the optimal
    planner cuts it, the fifth device left out; predicted as the sum of its copies."""
    chain = load_chain_like_smollm2()
    topo = Topology([f"d{i}" for i in range(5)], memory=0.6 * chain.total_param_bytes)
    p = plan(chain, topo, mode="replicate", batch=4, context_len=256, prompt_len=40,
             new_tokens=16)
    assert p.replicas == (("d0", "d1"), ("d2", "d3")) and p.devices_per_replica == 2
    first, second = p.replica_assignments()
    assert first == p.assignment and set(first.values()) == {"d0", "d1"}
    assert second == {s: {"d0": "d2", "d1": "d3"}[d] for s, d in first.items()}
    copies = [predict(chain, a, topo, 2, 256, 40, 16) for a in (first, second)]
    assert p.prediction.throughput == pytest.approx(sum(c.throughput for c in copies))
    assert p.prediction.memory == {**copies[0].memory, **copies[1].memory}
    assert "2 replicas of 2 segments each" in str(p) and str(p).count("embed ..") == 2
    assert Plan.load(p.save(tmp_path / "hybrid.json")) == p
    rebuilt = {}
    exec(p.to_python(), rebuilt)  # noqa: S102 - our own snippet, as a user pastes it
    assert rebuilt["plan"] == p
    bad = [[("d0", "d1"), "d2"], [("d0", "d1"), ("d1", "d2")], [("d1", "d0"), ("d2", "d3")]]
    for replicas, match in zip(bad, ["equal-length", "d1' is in two", "first copy"]):
        with pytest.raises(PlacementError, match=match):
            Plan(first, "replicate", replicas=replicas)
    with pytest.raises(PlacementError,
                       match="nor does any group of up to 2 consecutive devices of the 5"):
        plan(chain, topo.with_max_memory(0.3 * chain.total_param_bytes), mode="replicate")


def load_chain_like_smollm2():
    """SmolLM2-135M's shape (embed, 30 blocks, tied head) without reading the weights."""
    blocks = [Stage(f"block.{i}", "block", 14_155_776, 7_077_888, 2304, 1536,
                    attn_flops_per_context=2304) for i in range(30)]
    return LayerChain([Stage("embed", "embed", 113_246_208, 0, 2304, 0), *blocks,
                       Stage("head", "head", 113_248_512, 56_623_104, 196_608, 0)])


def test_memory_planner_is_accelerates_sequential_fill():
    # Accelerate: GPUs first, then CPU; a module goes to the current device while
    # used + size <= max_memory, otherwise to the next device, never back.
    chain = LayerChain([Stage(f"s{k}", "block", b * MB, 1, 4, 0)
                        for k, b in enumerate([3, 4, 2, 1, 2, 1])])
    topo = Topology(["/cpu:0", "/gpu:0", "/gpu:1"], memory=["100MB", "6MB", "7MB"])
    got = memory_assignment(chain, topo)
    assert got == {"s0": "/gpu:0",                                   # 3 <= 6; 3 + 4 > 6
                   "s1": "/gpu:1", "s2": "/gpu:1", "s3": "/gpu:1",  # 4 + 2 + 1 = 7 <= 7
                   "s4": "/cpu:0", "s5": "/cpu:0"}  # never back to gpu:0's 3 MB left
    assert plan(chain, topo, mode="memory", context_len=0).assignment == got


def test_greedy_is_the_whitepapers_earliest_finish_rule():
    # s0 costs 0 everywhere (a tie: the first device); s1 finishes first on the fast device
    # despite the 0.1 s hop; s2 stays there (no hop); then "fast" is full and s3 goes where it
    # finishes first counting its hop: mid (0.5 s hop + 2 s) beats slow (0.1 s hop + 4 s) ...
    chain = LayerChain([Stage("s0", "embed", 1 * MB, 0, 1000, 0),
                        Stage("s1", "block", 2 * MB, 4 * 10**9, 1000, 0),
                        Stage("s2", "block", 2 * MB, 4 * 10**9, 1000, 0),
                        Stage("s3", "head", 2 * MB, 4 * 10**9, 1000, 0)])
    lat = np.array([[0, 0.1, 0.1], [0.1, 0, 0.5], [0.1, 0.01, 0]])

    def topo(lat):
        return Topology(["slow", "fast", "mid"], memory=["10MB", "4MB", "10MB"],
                        flops=[1e9, 4e9, 2e9], latency=lat, bandwidth=1e9)

    assert greedy_assignment(chain, topo(lat), context_len=0) == {
        "s0": "slow", "s1": "fast", "s2": "fast", "s3": "mid"}
    lat[1, 2] = 3.0   # ... unless the hop to mid costs more than the 2 s it saves
    assert greedy_assignment(chain, topo(lat), context_len=0)["s3"] == "slow"


def test_fits_nowhere_says_by_how_much():
    chain = load_chain_like_smollm2()   # 651 MB of parameters in stages
    topo = Topology(["a", "b"], memory=["256MB", "256MB"])
    with pytest.raises(PlacementError) as e:
        plan(chain, topo, context_len=256)
    msg = str(e.value)
    assert "needs 651 MB + 12 MB KV" in msg and "has 512 MB: 151 MB short" in msg
    with pytest.raises(PlacementError, match=r"stage 'head' needs 113 MB .* has 100 MB: 13 MB"):
        plan(chain, Topology(["a", "b", "c", "d", "e", "f", "g", "h"], memory="100MB"),
             context_len=0)


def test_plan_json_round_trip_diff_and_python(tmp_path):
    chain = load_chain_like_smollm2()
    topo = Topology(["/job:worker/replica:0/task:0/device:CPU:0",
                     "/job:worker/replica:0/task:1/device:CPU:0"], memory="400MB",
                    flops=[1e10, 2e10])
    a = plan(chain, topo, mode="optimal", context_len=128)
    b = plan(chain, topo, mode="memory", context_len=128)
    assert Plan.load(a.save(tmp_path / "a.json")) == a
    rebuilt = {}
    exec(a.to_python(), rebuilt)  # noqa: S102 - our own snippet, as a user pastes it
    assert rebuilt["plan"] == a
    moves = a.diff(b)
    assert {(s, x, y) for s, x, y in moves.moves} == {
        (s, a.assignment[s], b.assignment[s]) for s in chain.names
        if a.assignment[s] != b.assignment[s]}
    assert not a.diff(a) and str(a.diff(a)) == "no stage moved"
    assert "worker:0/CPU:0 -> worker:1/CPU:0" in str(moves) or "worker:1/CPU:0 -> " in str(moves)
    segs = a.segments()
    assert [s for seg in segs for s in seg.stages] == chain.names
    assert all(x.device != y.device for x, y in zip(segs, segs[1:]))
    text, page = str(a), a._repr_html_()
    assert "worker:0/CPU:0" in text and "ms/token" in text and "<table>" in page


def test_bad_files_and_plans_are_refused(tmp_path):
    chain = tiny("llama").chain
    topo = Topology(["a", "b"], memory="1MB")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlacementError, match="not valid JSON"):
        Plan.load(bad)
    bad.write_text(json.dumps({"format": "tfnb.plan", "mode": "optimal"}))
    with pytest.raises(PlacementError, match="has no 'objective'"):
        Plan.load(bad)
    with pytest.raises(PlacementError, match="no plan file"):
        Plan.load(tmp_path / "missing.json")
    ok = dict.fromkeys(chain.names, "a")
    with pytest.raises(PlacementError, match="unknown stage 'blok.7'"):
        Plan.from_assignment(chain, {**ok, "blok.7": "a"}, topo)
    with pytest.raises(PlacementError, match="stage 'head' has no device"):
        Plan.from_assignment(chain, {k: v for k, v in ok.items() if k != "head"}, topo)
    with pytest.raises(PlacementError, match="unknown device 'z'"):
        Plan.from_assignment(chain, {**ok, "head": "z"}, topo)
    with pytest.raises(PlacementError, match=r"device 'a' would hold 0\.9 MB .* has 0\.1 MB"):
        Plan(ok).validate(chain, topo.with_max_memory({"a": "100kB"}))
    with pytest.raises(PlacementError, match="mode='fast'"):
        plan(chain, topo, mode="fast")
    with pytest.raises(PlacementError, match="objective='speed'"):
        plan(chain, topo, objective="speed")
    with pytest.raises(PlacementError, match="unknown device 'q'"):
        plan(chain, topo, max_memory={"q": "1GB"})


def test_measure_topology_on_real_cluster(cluster):
    from tfnb.placement import clear_cache

    clear_cache()
    topo = measure_topology(cluster, repeats=2, tensor_bytes=1_000_000, matmul_n=128)
    n = len(cluster.devices)
    assert topo.devices == tuple(cluster.devices) and n >= 2
    off = ~np.eye(n, dtype=bool)
    assert (topo.latency[off] > 0).all() and (topo.bandwidth[off] > 0).all()
    assert np.isfinite(topo.bandwidth[off]).all() and (topo.flops > 0).all()
    assert np.isfinite(topo.memory).all() and (topo.memory > 0).all()
    assert measure_topology(cluster, repeats=2, tensor_bytes=1_000_000, matmul_n=128) is topo
    assert len(topo.classes()) == 1   # two CPU workers on one host: one kind, smoothed
    p = plan(tiny("llama"), cluster, context_len=16)   # a Cluster goes through the cache
    assert set(p.assignment.values()) <= set(cluster.devices)


def test_plan_times_each_stage_on_the_cluster_once(cluster, tf_warnings):
    from tfnb.placement import clear_cache
    from tfnb.placement.planners import as_topology

    model = tiny("llama")
    clear_cache()
    topo = as_topology(cluster, model, 1, 16)
    # calibration's loops are tf.functions traced once each: TF's retracing warning would
    # only clutter the plan cell's output in a notebook
    assert not [m for m in tf_warnings if "retracing" in m], tf_warnings
    d0, d1 = cluster.devices[:2]
    assert set(topo.stage_times) == {(s, d) for s in model.chain.names for d in cluster.devices}
    assert all(t >= 0 for t in topo.stage_times.values())
    assert sum(topo.stage_times.values()) > 0
    # the two workers are one kind and time alike (a tiny model's times are mostly noise,
    # well within 1 ms): each is timed, and they share the mean
    assert topo.stage_times[("block.1", d0)] == topo.stage_times[("block.1", d1)]
    assert as_topology(cluster, model, 1, 16).stage_times == topo.stage_times  # cached
    p = plan(model, cluster, context_len=16)
    one_device = len(set(p.assignment.values())) == 1
    if one_device:   # no hop: the prediction is the sum of the calibrated stage times
        dev = p.assignment["embed"]
        assert p.prediction.latency_s == pytest.approx(
            sum(topo.stage_times[(s, dev)] for s in model.chain.names))
    assert as_topology(cluster).stage_times == {}   # without a model: FLOP estimates


def test_calibration_counts_the_typical_step_not_the_luckiest():
    # A timed call lasts a fraction of a second and a generate call seconds: the least
    # disturbed call of a calibration runs faster than generate will, so the median counts.
    import time

    from tfnb.runtime.calibrate import _per_step

    calls = []

    class Loop:  # 2 ms per step, except one call that ran undisturbed at 1 ms per step
        def __call__(self, n):
            calls.append(int(n))
            lucky = int(n) > 1 and calls.count(int(n)) == 3
            time.sleep(int(n) * (1e-3 if lucky else 2e-3))
            return self

        def numpy(self):
            return 0

    per = _per_step({"block": Loop()}, steps=24, repeats=5)["block"]
    assert 1.7e-3 < per < 2.6e-3   # the best calls would say ~1 ms
    assert calls.count(25) == 5 and calls.count(1) == 6   # a warm-up call, then alternated


def test_a_stage_hidden_by_the_machines_noise_is_not_timed_as_free():
    # A tiny stage timed once: its one short call hit a slow spell and took longer than the
    # long one. The planner must not see a stage that costs nothing (a prefill of 0 s made
    # a CI run's topology say every prompt was free).
    import time

    from tfnb.runtime.calibrate import _per_step

    class Loop:
        def __init__(self):
            self.calls = 0

        def __call__(self, n):
            self.calls += 1
            time.sleep(3e-3 if int(n) == 1 and self.calls > 1 else int(n) * 1e-4)
            return self

        def numpy(self):
            return 0

    per = _per_step({"prefill": Loop()}, steps=3, repeats=1)["prefill"]
    assert 1e-4 <= per < 3e-3   # the long call's time per iteration, overhead and all

def test_workers_on_different_cpus_are_different_kinds():
    import warnings

    import tfnb
    from tfnb.cluster.security import ExposedServerWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExposedServerWarning)
        c = tfnb.local(2, cpus=[None, "0"])
    try:
        assert [w.cpus for w in c.status().workers][1] == 1
        topo = measure_topology(c, repeats=1, tensor_bytes=100_000, matmul_n=64)
        assert len(topo.classes()) == 2
    finally:
        c.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs: one worker per CPU, a busy process sharing the first")
def test_a_worker_slowed_by_other_work_gets_its_own_stage_times():
    # Both workers are one kind by description (one CPU each, one host); a spinning process
    # shares worker 0's CPU. Calibration finds worker 0 slower, so the planner stops treating
    # the two as twins and keeps the model on worker 1, where the fill-first baseline does not.
    import subprocess
    import sys
    import warnings

    import tfnb
    from tfnb.cluster.security import ExposedServerWarning
    from tfnb.models import Model
    from tfnb.models.decoder import random_weights, tiny_config
    from tfnb.models.tokenizer import CharTokenizer
    from tfnb.placement.planners import as_topology

    config = tiny_config(vocab_size=256, hidden_size=512, ffn_size=1536, n_layers=8, n_heads=8,
                         n_kv_heads=4)
    model = Model("mid-llama", "llama", config, CharTokenizer(256), random_weights(config, 0))
    a, b = sorted(os.sched_getaffinity(0))[:2]
    spin = subprocess.Popen([sys.executable, "-c",
                             f"import os\nos.sched_setaffinity(0, {{{a}}})\nwhile True: pass"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExposedServerWarning)
            c = tfnb.local(2, cpus=[str(a), str(b)])
        try:
            d0, d1 = c.devices
            from tfnb.placement import clear_cache
            # A calibration on this busy machine can miss the spinner once, or time one stage
            # of worker 1 in a burst of other work, so that the planner rightly moves it.
            for _ in range(3):
                topo = as_topology(c, model, 1, 64)
                slow, fast = (sum(topo.stage_times[(s, d)] for s in model.chain.names)
                              for d in (d0, d1))
                assignment = plan(model, c, context_len=64).assignment
                if slow > fast * 1.3 and set(assignment.values()) == {d1}:
                    break
                clear_cache()
            assert slow > fast * 1.3, (slow, fast)
            assert len(topo.classes()) == 2
            moved = {s: (topo.stage_times[(s, d0)], topo.stage_times[(s, d1)])
                     for s, d in assignment.items() if d != d1}
            assert not moved, f"stages on the slowed worker (s there, s on the other): {moved}"
            assert set(plan(model, c, mode="memory", context_len=64).assignment.values()) == {d0}
        finally:
            c.stop()
    finally:
        spin.kill()
        spin.wait()


def test_optimal_falls_back_to_a_beam_search_when_every_device_differs():
    from tfnb.placement.planners import BEAM

    rng = np.random.default_rng(7)
    chain = random_chain(rng, 40)
    need = sum(stage_memory(chain, 1, 64))
    # 8 different devices: exact is feasible, and the beam gets within 1% of it
    topo8 = Topology([f"d{i}" for i in range(8)], memory=need / 8 * 1.5,
                     flops=rng.uniform(1e9, 4e9, 8), latency=rng.uniform(1e-4, 1e-3, (8, 8)),
                     bandwidth=1e9)
    for objective in ("latency", "throughput"):
        _, exact = optimal_segments(chain, topo8, 1, 64, objective)
        segs, beam = optimal_segments(chain, topo8, 1, 64, objective, beam=BEAM)
        assert exact <= beam <= exact * 1.01 and segs
    # 16 different devices: too many orders to search exactly; the plan says so and fits
    topo16 = Topology([f"d{i}" for i in range(16)], memory=need / 16 * 1.3,
                      flops=rng.uniform(1e9, 4e9, 16), latency=rng.uniform(1e-4, 1e-3, (16, 16)),
                      bandwidth=1e9)
    with pytest.warns(UserWarning, match="16 kinds of device among 16 .* not proven optimal"):
        p = plan(chain, topo16, context_len=64)
    assert not p.prediction.over_memory() and len(p.devices) >= 12
    greedy = plan(chain, topo16, mode="greedy", context_len=64)
    assert p.prediction.latency_s <= greedy.prediction.latency_s


@pytest.mark.parametrize("change, quoted", [
    ({"mode": 7}, "mode=7"),
    ({"batch": "x"}, "batch='x'"),
    ({"context_len": -1}, "context_len=-1"),
    ({"replicas": 5}, "replicas=5"),
    ({"assignment": ["a"]}, "'stages'"),
    ({"prediction": "bad"}, "'prediction'"),
])
def test_a_corrupt_plan_file_is_one_error_naming_the_value(tmp_path, change, quoted):
    path = Plan({"embed": "a", "block.0": "a", "block.1": "b", "head": "b"}).save(
        tmp_path / "p.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(PlacementError) as e:
        Plan.load(path)
    assert quoted in str(e.value) and "\n" not in str(e.value)


def test_a_directory_or_another_models_plan_is_refused(tmp_path):
    from tfnb.models import tiny

    with pytest.raises(PlacementError, match="is a directory"):
        Plan.load(tmp_path)
    other = Plan({"embed": "a", **{f"block.{i}": "a" for i in range(5)}, "head": "a"})
    with pytest.raises(PlacementError, match="block.2"):
        other.validate(tiny("llama").chain, ["a"])


def test_served_requests_count_their_prefills():
    """With ``prompt_len`` and ``new_tokens`` the throughput is of requests that each prefill
    a prompt and then decode: batch * new / max over resources of (batch * prefill + new *
    step), a device's prefill counting the wait while a prompt fills another device, for a
    split and for replicas; without them it is the decode steps' rate."""
    chain = tiny("llama").chain
    names = chain.names
    step = {"a": 2e-3, "b": 1e-3}   # seconds per decode step of each stage on each device
    pre = {"a": 10e-3, "b": 30e-3}  # seconds per prompt
    topo = Topology(["a", "b"], latency=0.0, bandwidth=math.inf,
                    stage_times={(s, d): step[d] for s in names for d in "ab"},
                    prefill_times={(s, d): pre[d] for s in names for d in "ab"})
    split = dict(zip(names, "aabb"))
    decode = predict(chain, split, topo, batch=4)
    assert decode.throughput == pytest.approx(4 / (2 * 2e-3))   # device a: 2 stages
    served = predict(chain, split, topo, batch=4, prompt_len=40, new_tokens=16)
    # a prompt holds the pipeline: while it fills one device the other lane's step queues
    # there, so the other device does that one step (2 * step) and then waits
    own = {"a": 2 * 10e-3, "b": 2 * 30e-3}
    wait = {"a": own["b"] - 2 * 2e-3, "b": own["a"] - 2 * 1e-3}
    busy = {d: 4 * (own[d] + wait[d]) + 16 * 2 * step[d] for d in "ab"}
    assert served.throughput == pytest.approx(4 * 16 / max(busy.values()))
    assert served.throughput < 4 * 16 / (4 * own["b"] + 16 * 2 * step["b"])  # its own work
    assert served.decode_throughput == pytest.approx(decode.throughput)
    assert served.prefill_s == {s: pre[d] for s, d in split.items()}
    assert "serving requests of 40 prompt + 16 new tokens" in str(
        Plan.from_assignment(chain, split, topo, 4, 64, prompt_len=40, new_tokens=16))
    copies = plan(chain, topo, mode="replicate", batch=4, context_len=64, prompt_len=40,
                  new_tokens=16).prediction
    assert copies.throughput == pytest.approx(sum(
        2 * 16 / (2 * 4 * pre[d] + 16 * 4 * step[d]) for d in "ab"))
    for bad in ({"prompt_len": 40}, {"new_tokens": 16}, {"prompt_len": -1, "new_tokens": 3}):
        with pytest.raises(PlacementError, match="prompt_len|new_tokens"):
            predict(chain, split, topo, **bad)


def test_slow_hops_make_the_lanes_bound_the_rate():
    """The runtime keeps one batch per device in flight, each going round every stage and hop
    per step: with hops as long as a stage, two lanes finish 2 batches per round, fewer than
    the busiest device alone would allow; more lanes lift that bound up to the device's."""
    chain = tiny("llama").chain
    names = chain.names
    topo = Topology(["a", "b"], latency=1e-3, bandwidth=math.inf,
                    stage_times={(s, d): 1e-3 for s in names for d in "ab"},
                    prefill_times={(s, d): 5e-3 for s in names for d in "ab"})
    split = dict(zip(names, "aabb"))
    p = predict(chain, split, topo, batch=4)
    assert (p.lanes, p.latency_s, p.bottleneck_s) == (2, pytest.approx(6e-3), pytest.approx(2e-3))
    assert p.lane_s == pytest.approx(3e-3)
    assert p.throughput == pytest.approx(2 * 4 / 6e-3)         # not 4 / 2e-3
    assert p.limit == ("2 lanes, each 6 ms per step round the devices (busiest: compute on a, "
                       "2 ms per step)")
    assert "bottleneck: 2 lanes, each 6 ms" in str(Plan.from_assignment(chain, split, topo, 4))
    four = predict(chain, split, topo, batch=4, lanes=4)
    assert four.throughput == pytest.approx(4 / 2e-3) and four.limit == "compute on a"
    served = predict(chain, split, topo, batch=4, prompt_len=8, new_tokens=16)
    ring = (4 * 5e-3 + 2e-3) / 2, 6e-3 / 2                      # per prompt, per step
    # a device: its own prefill (10 ms) and the wait while the prompt fills the other
    # (10 ms less the other lane's one step of 2 ms)
    device = 10e-3 + (10e-3 - 2e-3), 2e-3
    assert served.throughput == pytest.approx(4 * 16 / max(4 * ring[0] + 16 * ring[1],
                                                           4 * device[0] + 16 * device[1]))
    alone = predict(chain, dict.fromkeys(names, "a"), topo, batch=4)
    assert (alone.lanes, alone.throughput, alone.limit) == (1, pytest.approx(4 / 4e-3),
                                                            "compute on a")
    for bad in (0, 1.5, True):
        with pytest.raises(PlacementError, match="lanes="):
            predict(chain, split, topo, lanes=bad)


def test_plan_times_the_prefill_of_a_served_prompt(cluster):
    """``plan(prompt_len=...)`` on a cluster times every stage's prefill of such a prompt on
    every device, and the prediction is built from those times."""
    from tfnb.placement import clear_cache
    from tfnb.placement.planners import as_topology

    model = tiny("llama")
    clear_cache()
    p = plan(model, cluster, context_len=64, prompt_len=20, new_tokens=8)
    topo = as_topology(cluster, model, 1, 64, prompt_len=20)   # cached: the plan's own
    assert set(topo.prefill_times) == {(s, d) for s in model.chain.names
                                       for d in cluster.devices}
    assert sum(topo.prefill_times.values()) > 0
    assert p.prediction.prefill_s == {s: topo.prefill_times[(s, d)]
                                      for s, d in p.assignment.items()}
    assert 0 < p.prediction.throughput < p.prediction.decode_throughput


def test_a_served_plan_times_decode_at_the_requests_window_not_the_whole_cache(cluster):
    """With ``prompt_len`` and ``new_tokens`` the decode steps are timed over the caches such
    requests reach (as the runtime's window does), not all of ``context_len``, each step
    reading what such a request reads on average: a plan for short requests over a long cache
    carries the figures of a short context, the very ones a plan for that context calibrated
    (one cached calibration, not a second one)."""
    from tfnb.placement import clear_cache
    from tfnb.placement.planners import as_topology, attended_context, mean_attended

    model = tiny("llama")
    clear_cache()
    short = as_topology(cluster, model, 1, 24)
    served = plan(model, cluster, context_len=1024, prompt_len=20, new_tokens=8)
    assert attended_context(1024, 20, 8) == 32          # 20 tokens pad to 24, then 8 more
    assert mean_attended(1024, 20, 8) == 24             # the prompt and half the new tokens
    assert as_topology(cluster, model, 1, 1024, 20, None, 8).stage_times == short.stage_times
    dev = served.assignment["embed"]
    assert served.prediction.stage_s["block.0"] == short.stage_times[("block.0", dev)]
    assert served.prediction.memory == plan(model, cluster, context_len=1024,
                                            calibrate=False).prediction.memory  # caches: 1024


def test_a_topology_timer_times_the_stages_anew_at_every_call(cluster):
    """``topology_timer`` gives what ``as_topology`` calibrates for served requests (decode
    steps and prefills of every stage on every device), timed again at every call and not
    cached: a benchmark calls it between its rounds so its prediction sees the machine the
    rounds saw."""
    from tfnb.placement import Plan, clear_cache
    from tfnb.placement.planners import as_topology, topology_timer

    model = tiny("llama")
    clear_cache()
    planned = as_topology(cluster, model, 2, 64, 20, None, 8)
    timer = topology_timer(cluster, model, 2, 64, 20, None, 8)
    first, second = timer(1), timer(1)
    for timed in (first, second):
        assert set(timed.stage_times) == set(planned.stage_times)
        assert set(timed.prefill_times) == set(planned.prefill_times)
        assert sum(timed.stage_times.values()) > 0 and sum(timed.prefill_times.values()) > 0
    assert first.stage_times != second.stage_times       # timed again, not the cached table
    assert first.prefill_times != second.prefill_times
    assert as_topology(cluster, model, 2, 64, 20, None, 8).stage_times == planned.stage_times
    p = plan(model, cluster, batch=2, context_len=64, prompt_len=20, new_tokens=8)
    again = Plan.from_assignment(model.chain, p.assignment, first, 2, 64, prompt_len=20,
                                 new_tokens=8)
    assert 0 < again.prediction.throughput < again.prediction.decode_throughput
    with pytest.raises(PlacementError, match="model=None"):
        topology_timer(cluster, None, 2, 64, 20, None, 8)


def test_a_prompt_calibration_times_the_prefill_not_a_decode_step():
    """``time_stages(prompt=P)`` runs each segment's prefill of P tokens: a block with wide
    matrices takes far longer for 256 prompt tokens than for one decode step."""
    from tfnb.models.decoder import tiny_config
    from tfnb.runtime.calibrate import time_stages

    cfg = tiny_config(hidden_size=256, ffn_size=1024, n_layers=1, n_heads=4, n_kv_heads=2)
    dev = "/device:CPU:0"
    kw = dict(slots=256, steps=2, repeats=3, stream_bytes=0)
    step = time_stages(cfg, [dev], **kw)[dev]["block"]
    prefill = time_stages(cfg, [dev], prompt=256, **kw)[dev]["block"]
    assert prefill > 5 * step, (prefill, step)
    with pytest.raises(ValueError, match="prompt=300"):
        time_stages(cfg, [dev], prompt=300, **kw)


def test_plan_on_some_devices_of_a_cluster(cluster):
    """``plan(devices=[...])`` measures and places on those devices of the cluster only (a
    benchmark keeps one worker for a single-device placement beside a split over both);
    devices the cluster does not have are named in one error."""
    model = tiny("llama")
    first = cluster.devices[0]
    p = plan(model, cluster, devices=[first], context_len=64)
    assert set(p.assignment.values()) == {first}
    assert p.prediction.throughput > 0 and set(p.prediction.memory) == {first}
    both = plan(model, cluster, mode="replicate", devices=list(cluster.devices[:2]),
                context_len=64, calibrate=False)
    assert list(both.replicas) == list(cluster.devices[:2])
    for bad in (["/job:nowhere/device:CPU:0"], [], first, [first, first]):
        with pytest.raises(PlacementError, match="devices="):
            plan(model, cluster, devices=bad, calibrate=False)
    with pytest.raises(PlacementError, match="with a Cluster"):
        plan(model, ["a", "b"], devices=["a"])
