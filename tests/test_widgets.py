"""The placement editor, driven headless as a user would: ranges, rows, auto/manual, figures, Apply,
files.

Everything goes through the editor's public methods or its widgets' values (what a browser would
set); no front-end is needed.
"""
import doctest
import html
import importlib
import json
import re
import sys
import time

import ipywidgets as W
import numpy as np
import pytest
from IPython.core.error import UsageError
from traitlets import TraitError

from tfnb.errors import PlacementError
from tfnb.models import Model, tiny
from tfnb.models.decoder import LlamaConfig
from tfnb.notebook.widgets import PlacementEditor
from tfnb.notebook.widgets.layout import _load_upload
from tfnb.notebook.widgets.ranges import NONE
from tfnb.placement import Plan, Topology
from tfnb.placement import plan as make_plan


@pytest.fixture(scope="module")
def keras_model():
    """A 4-layer Keras chain (tf_keras, as TF_USE_LEGACY_KERAS selects)."""
    import tf_keras as K

    net = K.Sequential([K.Input((8,)), K.layers.Dense(32, activation="relu", name="d0"),
                        K.layers.Dense(32, activation="relu", name="d1"),
                        K.layers.Dense(16, activation="relu", name="d2"),
                        K.layers.Dense(4, name="out")])
    return Model("net", "keras", keras_model=net)


@pytest.fixture(scope="module")
def long_model():
    """SmolLM2's shape (32 stages) without weights: the chain is all the editor reads."""
    return Model("smol-shape", "llama", LlamaConfig(vocab_size=49152, hidden_size=576,
                                                    n_layers=30, n_heads=9, n_kv_heads=3,
                                                    ffn_size=1536))


def chain_model(n_stages: int) -> Model:
    """A decoder of ``n_stages`` stages (embed, blocks, head) with SmolLM2's widths, no weights."""
    return Model(f"shape-{n_stages}", "llama", LlamaConfig(
        vocab_size=49152, hidden_size=576, n_layers=n_stages - 2, n_heads=9, n_kv_heads=3,
        ffn_size=1536))


def workers(n: int) -> list[str]:
    return [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(n)]


def _spans(editor) -> list[str]:
    """The dataflow picture's box labels, top to bottom."""
    return re.findall(r'<g class="tfnb-segment".*?<text[^>]*>([^<]*)</text>',
                      editor.widgets.svg.value)


def _other(editor, stage):
    return next(d for d in editor.topology.devices if d != editor.assignment[stage])


def test_rows_and_auto_plan_match_tfnb_plan(cluster):
    model = tiny("llama")
    editor = PlacementEditor(model, cluster)
    assert list(editor.rows.boxes) == model.chain.names == list(editor.assignment)
    assert editor.mode == "auto" and editor.plan == make_plan(model, cluster)
    editor.plan.validate(model.chain, editor.topology)
    labels = dict(editor.rows.dropdowns["embed"].options)
    assert set(labels) == {"worker:0/CPU:0", "worker:1/CPU:0"}
    assert set(labels.values()) == set(cluster.devices)
    assert {s: d.value for s, d in editor.rows.dropdowns.items()} == editor.plan.assignment
    editor.planner = "memory"
    assert editor.plan == make_plan(model, cluster, mode="memory")
    editor.objective = "throughput"
    assert editor.plan.objective == "throughput" and editor.mode == "auto"
    undeclared = [n for n, t in PlacementEditor.class_traits().items()
                  if n not in W.VBox.class_traits() and not t.help]
    assert undeclared == []


def test_editing_a_row_switches_to_manual_and_updates_figures_and_svg(cluster):
    editor = PlacementEditor(tiny("llama"), cluster)
    before, svg = editor.plan.prediction, editor.widgets.svg.value
    figures = editor.widgets.figures.value
    target = _other(editor, "block.1")
    editor.rows.dropdowns["block.1"].value = target       # what a user's pick does
    after = editor.plan.prediction
    assert editor.mode == "manual" and editor.plan.mode == "manual"
    assert editor.assignment["block.1"] == target
    assert after.latency_s != before.latency_s and after.bytes_per_token > before.bytes_per_token
    assert editor.widgets.svg.value != svg and editor.widgets.figures.value != figures
    assert "/token" in editor.widgets.svg.value and editor.widgets.svg.value.count("<rect") >= 2
    editor.set_device("block.1", "worker:0/CPU:0" if "task:1" in target else "worker:1/CPU:0")
    assert editor.plan.prediction == before       # short labels work from code too
    editor.mode = "auto"
    assert editor.plan == make_plan(editor.model, cluster)
    with pytest.raises(PlacementError, match="'nowhere'.*expected one of"):
        editor.set_device("block.1", "nowhere")
    with pytest.raises(TraitError, match="no device for 'block.0'"):
        editor.assignment = {"embed": cluster.devices[0]}
    with pytest.raises(TraitError, match="batch=0"):
        editor.batch = 0


def test_over_memory_marks_the_row_and_disables_apply(cluster):
    dev0, dev1 = cluster.devices
    editor = PlacementEditor(tiny("llama"), cluster, max_memory={dev1: "10kB"})
    assert set(editor.assignment.values()) == {dev0} and editor.apply_disabled_reason == ""
    assert not editor.widgets.apply.disabled
    editor.set_device("block.0", dev1)
    reason = editor.apply_disabled_reason
    assert "worker:1/CPU:0" in reason and "over" in reason and "\n" not in reason
    assert editor.widgets.apply.disabled and reason in editor.widgets.reason.value
    assert editor.rows.highlighted() == ["block.0"] and dev1 in editor.over_memory
    assert "tfnb-over" in editor.rows.boxes["block.0"]._dom_classes
    assert editor.bars.bars[dev1].bar_style == "danger"
    assert "over memory" in editor.widgets.svg.value
    assert editor.apply() is None and "disabled" in editor.error
    assert editor.placed is None
    editor.set_device("block.0", dev0)
    assert editor.apply_disabled_reason == "" and editor.rows.highlighted() == []
    assert not editor.widgets.apply.disabled


def test_apply_places_a_keras_chain_across_workers(cluster, keras_model):
    dev0, dev1 = cluster.devices
    editor = PlacementEditor(keras_model, cluster, mode="manual")
    for stage in ("d2", "out"):
        editor.set_device(stage, dev1)
    seen = []
    editor.on_apply(seen.append)
    editor.widgets.apply.click()                                 # the Apply button
    placed = editor.placed
    assert editor.error == "" and editor.status.startswith("applied"), editor.status
    assert seen == [editor] and placed.plan == editor.plan
    assert placed.assignment == {"d0": dev0, "d1": dev0, "d2": dev1, "out": dev1}
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(placed(x), keras_model.keras_model(x), rtol=1e-5, atol=1e-6)
    editor.set_device("d1", dev1)
    again = editor.apply()
    assert again is editor.placed is not placed and "moving 1 stage" in editor.status
    assert again.assignment["d1"] == dev1 and len(seen) == 2
    np.testing.assert_allclose(again(x), keras_model.keras_model(x), rtol=1e-5, atol=1e-6)


def test_apply_errors_are_one_line(cluster, keras_model):
    editor = PlacementEditor(keras_model, ["a", "b"])      # devices the cluster does not have
    assert editor.apply() is None and editor.placed is None
    assert editor.error.startswith("Apply failed:") and "'a'" in editor.error
    assert "\n" not in editor.error and "Traceback" not in editor.widgets.status.value
    assert not editor.busy and not editor.widgets.apply.disabled


def test_apply_places_the_tiny_llama(cluster):
    editor = PlacementEditor(tiny("llama"), cluster, mode="manual")
    editor.set_device("head", cluster.devices[1])
    placed = editor.apply()
    assert placed is not None, editor.error
    assert placed is editor.placed and placed.plan == editor.plan and "\n" not in editor.status
    assert placed.assignment == editor.assignment
    # the status says how each device multiplies (a float32 model: float32 everywhere)
    assert editor.status.endswith("weights: worker:0/CPU:0 float32, worker:1/CPU:0 float32"), \
        editor.status
    editor.set_device("block.1", cluster.devices[1])
    moved = editor.apply()                                 # previous=placed goes to tfnb.place
    assert moved is editor.placed and moved.assignment["block.1"] == cluster.devices[1], \
        editor.error
    assert "moving 1 stage" in editor.status


def test_json_export_and_load_round_trip_and_refusals(cluster, keras_model, tmp_path):
    dev0, dev1 = cluster.devices
    editor = PlacementEditor(tiny("llama"), cluster)
    editor.set_device("head", dev1)
    path = editor.export_json(tmp_path / "plan.json")
    assert Plan.load(path) == editor.plan
    assert editor.widgets.json.value == ""           # filled when "Export / load" is opened
    editor.widgets.export.selected_index = 0
    assert json.loads(editor.widgets.json.value) == json.loads(path.read_text())
    editor.set_device("block.0", dev1)                # kept up to date while it is open
    assert json.loads(editor.widgets.json.value)["assignment"]["block.0"] == dev1
    editor.set_device("block.0", dev0)
    ns = {}
    exec(editor.widgets.python.value, ns)                      # noqa: S102 - our own snippet
    assert ns["plan"] == editor.plan
    assert "data:application/json;base64," in editor.widgets.download.value

    fresh = PlacementEditor(tiny("llama"), cluster, objective="throughput")
    assert fresh.load(path) == editor.plan and fresh.mode == "manual"
    assert fresh.assignment == editor.assignment and fresh.objective == "latency"
    assert fresh.rows.dropdowns["head"].value == dev1

    kept = dict(fresh.assignment)
    (tmp_path / "bad.json").write_text("{not json")
    other = PlacementEditor(keras_model, cluster)
    other.export_json(tmp_path / "keras.json")
    tight = PlacementEditor(tiny("llama"), cluster, max_memory={dev1: "10kB"})
    for src, ed, word in [(tmp_path / "bad.json", fresh, "not valid JSON"),
                          (tmp_path / "missing.json", fresh, "no plan file"),
                          (tmp_path / "keras.json", fresh, "unknown stage 'd0'"),
                          (path, tight, "over")]:
        assert ed.load(src) is None
        assert ed.error.startswith("plan refused:") and word in ed.error and "\n" not in ed.error
    assert fresh.assignment == kept and tight.assignment == dict.fromkeys(kept, dev0)
    _load_upload(fresh, [{"name": "up.json", "content": memoryview(b"[1, 2]")}])
    assert fresh.error.startswith("plan refused:") and fresh.assignment == kept
    _load_upload(tight, [{"name": "up.json", "content": memoryview(path.read_bytes())}])
    assert "over" in tight.error


def test_tfplace_magic(ipython, cluster, capsys, monkeypatch):
    ipython.user_ns["m"] = tiny("llama")
    res = ipython.run_cell("%tfplace m --objective throughput --route xla -o ed",
                           store_history=False)
    editor = res.result
    assert res.error_in_exec is None and isinstance(editor, PlacementEditor)
    assert ipython.user_ns["ed"] is editor and editor.objective == "throughput"
    assert editor.route == "xla"  # what Apply hands tfnb.place
    assert editor.plan == make_plan(editor.model, cluster, objective="throughput")
    capsys.readouterr()
    for line, word in [("%tfplace nosuchvar", "nosuchvar"), ("%tfplace m --mode sideways", "mode"),
                       ("%tfplace m --route fast", "route"),
                       ("%tfplace m.chain", "not a variable name"), ("%tfplace", "model")]:
        res = ipython.run_cell(line, store_history=False)
        out = capsys.readouterr()
        printed = (out.out + out.err).strip()
        assert isinstance(res.error_in_exec, UsageError), line
        assert word in printed and "Traceback" not in printed and len(printed.splitlines()) <= 2
    with monkeypatch.context() as mp:
        mp.setattr(sys.modules["tfnb.cluster.connect"], "_current", None)
        res = ipython.run_cell("%tfplace m", store_history=False)
    out = capsys.readouterr()
    assert isinstance(res.error_in_exec, UsageError) and "not connected" in out.out + out.err
    doc = ipython.magics_manager.magics["line"]["tfplace"].__doc__
    assert "--objective" in doc and "-o OUTPUT" in doc and "%tfplace model" in doc


def test_displayable_with_a_text_fallback(long_model):
    devices = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(2)]
    editor = PlacementEditor(long_model, Topology(devices, memory="2GB"))
    bundle = editor._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == editor.model_id
    text = bundle["text/plain"]
    assert "block.29" in text and "Apply: ready" in text and "ms/token" in text
    assert repr(editor).startswith("PlacementEditor(smol-shape: 32 stages")


def test_a_change_on_32_stages_touches_only_what_changed(long_model, monkeypatch):
    devices = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(2)]
    editor = PlacementEditor(long_model, Topology(devices, memory="2GB"), mode="manual")
    rows = dict(editor.rows.boxes)
    values = {s: d.value for s, d in editor.rows.dropdowns.items()}
    sent = []
    monkeypatch.setattr(W.Widget, "send_state", lambda self, key=None: sent.append((self, key)))
    editor.set_device("block.7", devices[1])
    assert editor.rows.boxes == rows                       # same row widgets, not rebuilt
    moved = [s for s, d in editor.rows.dropdowns.items() if d.value != values[s]]
    assert moved == ["block.7"]
    touched_rows = {w for w, _ in sent if any(w in b.children for b in rows.values())}
    assert touched_rows == {editor.rows.dropdowns["block.7"], editor.rows.names["block.7"]}
    assert len(sent) < 30, len(sent)


def test_long_chains_scroll_inside_the_table_instead_of_squashing_rows(long_model):
    """The browser test saw 32 rows squeezed into 460 px: rows keep their height, the table scrolls.

    ipywidgets 8's Layout has ``overflow`` (``overflow_y`` is silently dropped), and flex items
    shrink unless told not to.
    """
    editor = PlacementEditor(long_model, ["a", "b"])
    editor.widgets.detail.selected_index = 0               # open the per-stage detail
    table = editor.rows.widget.children[1]
    assert table.layout.max_height == "460px" and table.layout.overflow == "auto"
    assert all(box.layout.flex == "0 0 auto" for box in editor.rows.boxes.values())


def test_one_row_per_device_and_the_per_stage_rows_a_collapsed_lazy_detail(long_model):
    devices = workers(2)
    editor = PlacementEditor(long_model, Topology(devices, memory="2GB"), mode="manual")
    editor.set_ranges({devices[0]: ("embed", "block.11"), devices[1]: ("block.12", "head")})
    ranges = editor.range_rows
    assert ranges.order == tuple(devices) and list(editor.ranges) == devices
    assert [(ranges.firsts[d].value, ranges.lasts[d].value) for d in devices] == [(0, 12), (13, 31)]
    assert ranges.summaries[devices[1]].value == "block.12 .. head (19 stages)"
    assert _spans(editor) == ["embed .. block.11 (13)", "block.12 .. head (19)"]
    detail = editor.widgets.detail
    assert detail.selected_index is None and "per-stage detail (32 stages)" in detail.titles[0]
    assert not editor.rows.built and editor.rows.widget.children == ()   # nothing made yet
    assert detail.children == (editor.rows.widget,) and editor.widgets.detail in \
        editor.children[3].children[0].children
    detail.selected_index = 0                              # a user opens it
    assert editor.rows.built and len(editor.rows.widget.children) == 2
    assert {s: d.value for s, d in editor.rows.dropdowns.items()} == editor.assignment
    editor.rows.dropdowns["block.12"].value = devices[0]   # a per-stage edit shows in the ranges
    assert ranges.lasts[devices[0]].value == 13 and editor.ranges[devices[1]] == \
        [("block.13", "head")]


def test_a_range_edit_on_200_stages_and_8_devices_updates_everything(capsys):
    model, devices = chain_model(200), workers(8)
    editor = PlacementEditor(model, Topology(devices, memory="4GB"), mode="manual")
    names = model.chain.names
    editor.set_ranges([(d, 25 * i, 25 * i + 24) for i, d in enumerate(devices)])
    editor.widgets.detail.selected_index = 0
    assert editor.plan.segments() == [seg for seg in editor.plan.segments()] and \
        [len(seg.stages) for seg in editor.plan.segments()] == [25] * 8
    before, svg, figures = editor.plan.prediction, editor.widgets.svg.value, \
        editor.widgets.figures.value
    memory = {d: editor.bars.labels[d].value for d in devices}
    start = time.perf_counter()
    editor.range_rows.lasts[devices[2]].value = 59          # worker:2 runs 10 fewer stages
    took = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n200 stages on 8 devices: one range edit took {took * 1e3:.1f} ms "
              "(benchmarks/bench_editor.py times it)")
    want = [d for i, d in enumerate(devices) for _ in range(25)]
    want[50:60], want[60:75] = [devices[2]] * 10, [devices[3]] * 15
    assert editor.assignment == dict(zip(names, want))
    assert editor.ranges[devices[3]] == [(names[60], names[99])]      # the next device's first
    assert editor.range_rows.firsts[devices[3]].value == 60 and names[60] == "block.59"
    assert editor.status == "worker:2/CPU:0 runs block.49 .. block.58" and editor.error == ""
    after = editor.plan.prediction
    assert after != before and after.memory[devices[3]] > before.memory[devices[3]]
    assert editor.widgets.figures.value != figures and editor.widgets.svg.value != svg
    assert _spans(editor)[2:4] == ["block.49 .. block.58 (10)", "block.59 .. block.98 (40)"]
    assert editor.bars.labels[devices[3]].value != memory[devices[3]]
    assert {s: d.value for s, d in editor.rows.dropdowns.items()} == editor.assignment
    editor.range_rows.firsts[devices[2]].value = 45         # its first moves worker:1's last
    assert editor.ranges[devices[1]] == [(names[25], names[44])]
    assert editor.rows.dropdowns[names[45]].value == devices[2]


def test_bad_ranges_are_refused_with_one_clear_message():
    model, devices = chain_model(40), workers(4)
    editor = PlacementEditor(model, Topology(devices, memory="4GB"), mode="manual")
    editor.set_ranges({d: (10 * i, 10 * i + 9) for i, d in enumerate(devices)})
    kept, names = dict(editor.assignment), model.chain.names
    for args, words in [((devices[1], "block.99", "head"), ["first='block.99'", "'embed' .. "
                                                           "'head'", "0 .. 39"]),
                        ((devices[1], 15, 12), ["comes after", "first <= last"]),
                        ((devices[1], 22, 25), ["worker:2/CPU:0 would run 2 separate ranges"]),
                        ((devices[1], 5, 35), ["takes every stage of worker:2/CPU:0",
                                               "the x button of its row"]),
                        (("worker:9/CPU:0", 0, 3), ["'worker:9/CPU:0'", "expected one of"])]:
        with pytest.raises(PlacementError) as info:
            editor.set_range(*args)
        assert all(w in str(info.value) for w in words), (args, str(info.value))
        assert "\n" not in str(info.value)
    assert editor.assignment == kept
    for ranges, word in [({devices[0]: (0, 20), devices[1]: (15, "head")},
                          "in the ranges of both"),
                         ({devices[0]: (0, 20), devices[1]: (22, "head")},
                          "no device for 'block.20'"),
                         ({devices[0]: "embed"}, "expected (first, last)"),
                         ({"nowhere": (0, "head")}, "'nowhere' is not in the topology")]:
        with pytest.raises(PlacementError, match=re.escape(word)):
            editor.set_ranges(ranges)
    last = editor.range_rows.lasts[devices[0]]
    last.value = 35                                       # what a browser would send
    assert editor.error.startswith("range of worker:0/CPU:0") and "takes every stage" in \
        editor.error and html.escape(editor.error) in editor.widgets.status.value
    assert last.value == 9 and editor.assignment == kept    # the field went back to the plan
    for field, value in [(last, 999), (editor.range_rows.firsts[devices[0]], NONE)]:
        field.value = value                               # typed, or ArrowDown at position 0
        assert f"={value}: expected a stage name ('embed' .. 'head') or a position 0 .. 39" in \
            editor.error and editor.assignment == kept and field.value in (0, 9)
    last.value = 11                                       # a good edit clears the error
    assert editor.error == "" and editor.ranges[devices[1]] == [(names[12], names[19])]


def test_a_device_joins_hands_over_and_leaves_the_pipeline():
    model, devices = chain_model(24), workers(3)
    editor = PlacementEditor(model, Topology(devices, memory="4GB"), mode="auto")
    editor.set_ranges({devices[0]: (0, 11), devices[1]: (12, 23)})
    assert editor.mode == "manual" and editor.range_rows.order == tuple(devices)
    new = editor.range_rows
    assert (new.firsts[devices[2]].value, new.summaries[devices[2]].value) == \
        (NONE, "unused: type a position to add it") and new.removes[devices[2]].disabled
    new.lasts[devices[2]].value = 23                      # an unused device picks the head
    assert editor.ranges == {devices[0]: [("embed", "block.10")],
                             devices[1]: [("block.11", "block.21")], devices[2]: [("head", "head")]}
    new.firsts[devices[2]].value = 20                     # then grows up to block.19
    assert editor.ranges[devices[2]] == [("block.19", "head")]
    editor.set_range(devices[0], "block.11", "block.18")  # exactly worker:1's range: hand-over
    assert list(editor.ranges) == [devices[1], devices[0], devices[2]]
    assert editor.ranges[devices[1]] == [("embed", "block.10")]
    assert new.order == (devices[1], devices[0], devices[2])       # rows in pipeline order
    new.removes[devices[0]].click()                       # x: worker:0 leaves the pipeline
    assert editor.ranges == {devices[1]: [("embed", "block.18")],
                             devices[2]: [("block.19", "head")]}
    assert new.order[-1] == devices[0] and new.firsts[devices[0]].value == NONE
    editor.set_range(devices[1])
    assert editor.ranges == {devices[2]: [("embed", "head")]}
    with pytest.raises(PlacementError, match="runs every stage"):
        editor.set_range(devices[2])


def test_non_contiguous_plans_show_every_run_and_a_range_edit_packs_them():
    model, devices = chain_model(12), workers(2)
    editor = PlacementEditor(model, Topology(devices, memory="4GB"), mode="manual")
    names = model.chain.names
    editor.assignment = {s: devices[k % 2] for k, s in enumerate(names)}   # alternating
    assert [len(r) for r in editor.ranges.values()] == [6, 6] and len(_spans(editor)) == 12
    summary = editor.range_rows.summaries[devices[0]].value
    assert summary.startswith("6 stages in 6 runs: embed, block.1, ")
    assert summary.endswith("block.9")
    assert (editor.range_rows.firsts[devices[1]].value,
            editor.range_rows.lasts[devices[1]].value) == (1, 11)               # its span
    editor.set_range(devices[0], "embed", "block.5")      # packed first (6 + 6), then edited
    assert editor.ranges == {devices[0]: [("embed", "block.5")], devices[1]: [("block.6", "head")]}
    assert _spans(editor) == ["embed .. block.5 (7)", "block.6 .. head (5)"]


@pytest.mark.parametrize("module", ["ranges", "views", "layout", "placement", "dataflow"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"tfnb.notebook.widgets.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_a_fragmented_plan_is_drawn_as_one_strip_not_200_boxes():
    model, devices = chain_model(200), workers(8)
    editor = PlacementEditor(model, Topology(devices, memory="8GB"), mode="manual")
    names = model.chain.names
    editor.assignment = {s: devices[k % 8] for k, s in enumerate(names)}
    svg = editor.widgets.svg.value
    assert "tfnb-strip" in svg and svg.count('class="tfnb-run"') == 200
    assert svg.count('class="tfnb-legend"') == 8 and "worker:0/CPU:0: 25 stages in 25 runs" in svg
    assert "200 segments, 199 hops" in svg and int(re.search(r'height="(\d+)"', svg)[1]) < 500
    editor.set_range(devices[0], "embed", "block.30")      # packed: one box per device again
    assert "tfnb-strip" not in editor.widgets.svg.value and len(_spans(editor)) == 8
