"""The serving view on real workers: a placed model's status while concurrent requests run
(rows in use, tokens so far, then the finished ones), and the widget redrawing it by itself."""
import gc
import re
import threading
import time

import pytest

import tfnb
from tfnb.models import tiny
from tfnb.notebook.widgets import ServingView
from tfnb.notebook.widgets.serving_view import (
    ServingText,
    ServingViewError,
    serving_html,
    serving_text,
)

from tests.test_replicas import concurrently

PROMPTS = ["hello world", "the cat sat", "one two three"]
N = 96  # tokens per request: long enough to watch, in chunks of 4


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture
def placed(cluster, model):
    placed = tfnb.place(model, [cluster.devices[0]], cluster)
    placed.eos_ids = ()  # every request makes all its tokens
    return placed


def _in_background(placed, prompts, n=N):
    """Run ``prompts`` concurrently on ``placed`` in a thread; the thread and its results."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(concurrently(
        lambda p: placed.generate_ids(p, max_new_tokens=n, chunk_tokens=4), prompts)))
    thread.start()
    return thread, out


def _until(condition, timeout=90.0, every=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


def test_status_shows_requests_in_flight_then_the_finished_ones(placed):
    assert placed.serving_status()["in_flight"] == 0
    thread, out = _in_background(placed, PROMPTS)

    def all_decoding():
        st = placed.serving_status()
        reqs = st["requests"]
        return st if len(reqs) == 3 and all(r["state"] == "decoding" for r in reqs) else None

    first = _until(all_decoding)
    assert first["in_flight"] == 3
    lane = first["replicas"][0]["lanes"][0]
    assert lane["rows_in_use"] == 3 and lane["rows"] >= 3 and lane["waiting"] == 0
    ids = [r["id"] for r in first["requests"]]
    made = {r["id"]: r["tokens"] for r in first["requests"]}
    assert all(r["max_tokens"] == N and r["first_token_s"] is not None for r in first["requests"])

    def more_tokens():
        st = placed.serving_status()
        now = {r["id"]: r["tokens"] for r in st["requests"]}
        return now if now.keys() == made.keys() and all(now[i] > made[i] for i in ids) else None

    later = _until(more_tokens)
    assert all(N > later[i] > made[i] for i in ids)  # still in flight, further on
    thread.join(120)
    assert all(out[p] and len(out[p]) == N for p in PROMPTS)

    done = placed.serving_status()
    assert done["in_flight"] == 0 and done["replicas"][0]["lanes"][0]["rows_in_use"] == 0
    recent = {r["id"]: r for r in done["recent"]}
    assert set(ids) <= recent.keys()
    for i in ids:
        r = recent[i]
        assert r["state"] == "done" and r["tokens"] == N and r["tokens_per_s"] > 0
        assert 0 <= r["queue_s"] <= r["first_token_s"] <= r["age_s"]


def test_the_widget_redraws_itself_while_requests_run(placed):
    view = ServingView(placed, interval=0.1)
    try:
        assert view.running and view.thread.is_alive()
        assert "no requests in flight" in view.html.value
        thread, out = _in_background(placed, PROMPTS)
        seen = set()

        def three_rows_drawn():  # the test thread only reads: the view's thread draws
            seen.add(view.html.value)
            return view.html.value.count("decoding") == 3 and "3/" in view.html.value
        _until(three_rows_drawn)
        ids = [r["id"] for r in view.status["requests"]]
        assert all(f"#{i}" in view.html.value for i in ids)
        thread.join(120)
        _until(lambda: "finished last" in view.html.value and view.status["in_flight"] == 0,
               timeout=10)
        assert len(seen) >= 2  # it changed on its own, more than once
        assert all(f"#{i}" in view.html.value for i in ids)  # now as finished requests
    finally:
        view.stop()
    assert not view.thread.is_alive() and not view.running
    value = view.html.value
    placed.generate_ids("x y", max_new_tokens=4)
    time.sleep(0.3)
    assert view.html.value == value  # stopped: nothing redraws it


def test_the_view_ends_with_its_model_or_when_closed(cluster, model):
    placed = tfnb.place(model, [cluster.devices[0]], cluster)
    view = ServingView(placed, interval=0.05)
    assert view.model is placed
    del placed
    gc.collect()
    view.thread.join(10)
    assert not view.thread.is_alive() and view.model is None and not view.running
    assert "gone" in view.html.value

    other = ServingView(tfnb.place(model, [cluster.devices[0]], cluster), interval=0.05)
    other.close()
    assert not other.thread.is_alive()


def test_a_replicated_model_shows_one_section_per_replica(cluster, model):
    placed = tfnb.place(model, tfnb.plan(model, cluster, mode="replicate", calibrate=False),
                        cluster)
    placed.eos_ids = ()
    view = ServingView(placed, interval=0.1)
    try:
        assert view.html.value.count("class='tfnb-replica'") == 2
        thread, out = _in_background(placed, PROMPTS[:2], n=64)
        st = _until(lambda: (lambda s: s if all(r["requests"] for r in s["replicas"])
                             else None)(view.status))
        assert [r["replica"] for r in st["replicas"]] == [0, 1]
        assert [r["devices"] for r in st["replicas"]] == [[d] for d in cluster.devices]
        assert sorted(r["replica"] for r in st["requests"]) == [0, 1]  # one request each
        thread.join(120)
        assert all(len(out[p]) == 64 for p in PROMPTS[:2])
    finally:
        view.stop()


def test_bad_arguments_name_the_value(placed):
    with pytest.raises(ServingViewError, match=r"model='placed'.*tfnb.place"):
        ServingView("placed")
    for bad in (0, -1.0, float("nan"), "fast", True):
        with pytest.raises(ServingViewError, match=r"interval=.*number > 0"):
            tfnb.serving_view(placed, interval=bad)
    view = ServingView(placed, interval=1.0)
    try:
        with pytest.raises(Exception, match=r"interval=-2"):
            view.interval = -2
        assert view.interval == 1.0
    finally:
        view.stop()


def test_server_view_and_the_magic_option(placed, ipython, monkeypatch):
    pytest.importorskip("uvicorn")
    import tfnb.notebook
    from tfnb.notebook import magics

    shown = []
    monkeypatch.setattr(magics, "display", shown.append)
    monkeypatch.setattr(tfnb.notebook, "in_kernel", lambda: True)  # as in Jupyter: the widget
    ipython.user_ns["placed_for_view"] = placed
    server = ipython.run_line_magic("tfserve", "placed_for_view --view -o served")
    try:
        assert ipython.user_ns["served"] is server
        (view,) = shown
        assert isinstance(view, ServingView) and view.running
        assert "replica 0" in view.html.value and view.model is server.placed
        view.stop()
        monkeypatch.setattr(tfnb.notebook, "in_kernel", lambda: False)  # a terminal: text
        other = tfnb.serving_view(server, interval=0.2)
        assert isinstance(other, ServingText)
        assert other.status["replicas"][0]["devices"] == placed.devices
        other.close()
        assert not other.running and "replica 0 on " in other.text
    finally:
        server.close()
        del ipython.user_ns["placed_for_view"], ipython.user_ns["served"]


def test_outside_a_kernel_the_view_prints_rows_and_requests_in_flight(placed, capsys):
    view = tfnb.serving_view(placed, interval=0.05)  # pytest is no Jupyter kernel
    try:
        assert isinstance(view, ServingText) and view.running
        assert str(view) in capsys.readouterr().out and "0 in flight" in view.text
        thread, out = _in_background(placed, PROMPTS)
        _until(lambda: re.search(r"lane 0: 3/\d+ rows in use, 3 in flight: #\d+ \d+/96, ",
                                 view.text))
        thread.join(120)
        _until(lambda: view.text.endswith("rows in use, 0 in flight"), timeout=10)
    finally:
        view.stop()
    assert not view.thread.is_alive() and not view.running and "stopped" in repr(view)
    printed = capsys.readouterr().out
    assert printed.count("3 request(s) in flight") >= 2  # a print per redraw that changed it
    assert printed.rstrip("\n").endswith(view.text)
    placed.generate_ids("x y", max_new_tokens=4)
    time.sleep(0.3)
    assert capsys.readouterr().out == ""  # stopped: nothing prints any more


def test_status_as_text_names_each_replica_and_lane():
    status = {"model": "m", "in_flight": 9, "recent": [], "requests": [], "replicas": [
        {"replica": r, "devices": [f"/job:worker/replica:0/task:{r}/device:CPU:0"],
         "lost": "worker gone" if r else None,
         "requests": [{"id": i, "lane": 0, "tokens": i, "max_tokens": 50} for i in range(9)]
         if not r else [],
         "lanes": [{"lane": 0, "rows": 16, "rows_in_use": 9 if not r else 0, "waiting": 2,
                    "waiting_rows": 2, "slot": 1, "slots": 8, "steps": 1}]} for r in (0, 1)]}
    assert serving_text(status).splitlines() == [
        "m: 9 request(s) in flight on 2 replica(s)",
        "  replica 0 on worker:0/CPU:0",
        "    lane 0: 9/16 rows in use, 9 in flight: #0 0/50, #1 1/50, #2 2/50, #3 3/50, "
        "#4 4/50, #5 5/50, +3 more, 2 waiting",
        "  replica 1 on worker:1/CPU:0 (lost: worker gone)",
        "    lane 0: 0/16 rows in use, 0 in flight, 2 waiting"]


def test_a_copy_being_restored_says_so_in_text_and_html():
    status = {"model": "m", "in_flight": 0, "recent": [], "requests": [], "replicas": [
        {"replica": r, "devices": [f"/job:worker/replica:0/task:{r}/device:CPU:0"],
         "state": state, "lost": None, "requests": [], "lanes": []}
        for r, state in ((0, "serving"), (1, "restoring"))]}
    assert serving_text(status).splitlines()[1:] == [
        "  replica 0 on worker:0/CPU:0", "  replica 1 on worker:1/CPU:0 (restoring)"]
    html_text = serving_html(status)
    assert html_text.count("restoring") == 1 and "serving</span>" not in html_text
