"""An endpoint that heals itself: a copy lost with its worker is placed again once the worker is
restarted on the same address, warmed and put back in rotation, while clients keep asking; a
split placement answers 503 with Retry-After while it is down and serves again once healed.
Real workers on 127.0.0.1, driven by the official ``openai`` client."""
import threading
import time
import warnings

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the endpoint tests drive it with the openai client")

import tfnb
from tfnb.models import tiny
from tfnb.runtime import ReplicaLostWarning, ReplicaRestoredWarning

QUESTIONS = ["hello", "what is two", "the cat sat", "a b c", "good day", "tell me"]
# From the restarted worker answering to its copy back in rotation: noticing it, reconnecting
# and placing take about 1 s; the rest is the copy's warm-up (14 greedy shapes here), compiled
# while the other copy serves the clients on the same two cores: 21-39 s measured.
HEAL_BOUND_S = 60.0
WARM = {"modes": ("greedy",), "prompt_tokens": 32}  # a small warm-up: the healed copy repeats it


def _client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def _ask(client, question):
    out = client.chat.completions.create(model="tiny-llama", max_tokens=16, temperature=0,
                                         messages=[{"role": "user", "content": question}])
    return out.choices[0].message.content


def _ask_streamed(client, question):
    parts = []
    for chunk in client.chat.completions.create(
            model="tiny-llama", max_tokens=16, temperature=0, stream=True,
            messages=[{"role": "user", "content": question}]):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def _health(server):
    return httpx.get(server.url.removesuffix("/v1") + "/health", timeout=5)


def _until(check, bound: float, every: float = 0.2):
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    return check()


class Clients:
    """``n`` threads asking the endpoint in turn until stopped, every other one streaming; each
    request's start and end (``time.monotonic()``), question and answer (or the error)."""

    def __init__(self, server, n: int = 2):
        self.log, self.stop = [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(server, i), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, server, i):
        client, k, ask = _client(server), i, _ask_streamed if i % 2 else _ask
        while not self.stop.is_set():
            q, start = QUESTIONS[k % len(QUESTIONS)], time.monotonic()
            try:
                answer = ask(client, q)
            except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                answer = e
            self.log.append((start, time.monotonic(), q, answer))
            k += 1
            time.sleep(0.05)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads)
        return self.log


@pytest.fixture
def replicated(own_cluster):
    model = tiny("llama")
    plan = tfnb.plan(model, own_cluster, mode="replicate", calibrate=False)
    placed = tfnb.place(model, plan, own_cluster)
    placed.warmup(**WARM)
    yield own_cluster, placed
    placed.close()


def test_a_restarted_workers_copy_rejoins_while_clients_keep_asking(own_workers, replicated):
    """Eight clients, four of them streaming, keep asking through a worker's loss and restart:
    every answer, those cut by the loss included, is the greedy answer of a run without the
    fault (a request on the lost copy goes on on the other), and the copy rejoins."""
    cluster, placed = replicated
    d0, d1 = cluster.devices
    with tfnb.serve(placed, warmup=False) as server:
        client = _client(server)
        expected = {q: _ask(client, q) for q in QUESTIONS}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            clients = Clients(server, 8)
            try:
                time.sleep(1.0)
                own_workers.kill(1)
                # the copy on task 1 is dropped once a request (or the healer) finds it gone
                assert _until(lambda: placed.serving_status()["replicas"][1]["state"] == "lost",
                              15)
                time.sleep(1.0)
                own_workers.restart(1)
                restarted = time.monotonic()
                healed = _until(lambda: placed.serving_status()["replicas"][1]["restored_at"],
                                HEAL_BOUND_S + 5)
                heal_s = time.monotonic() - restarted
                assert healed and heal_s < HEAL_BOUND_S, (heal_s, placed.serving_status())
                at_heal = placed.served[d1]
                # requests land on the restored copy again
                assert _until(lambda: placed.served[d1] >= at_heal + 3, 30), placed.served
            finally:
                log = clients.finish()
        print(f"healed {heal_s:.1f} s after the restart; {len(log)} requests")
        kinds = [w.category for w in seen]
        assert ReplicaLostWarning in kinds and ReplicaRestoredWarning in kinds, kinds
        wrong = [(q, a) for _, _, q, a in log if a != expected[q]]
        assert not wrong, (len(wrong), len(log), wrong[:3])
        assert any(start >= restarted for start, *_ in log)
        assert placed.serving_status()["moved"] >= 1  # some were cut by the loss
        st = placed.serving_status()
        assert [r["state"] for r in st["replicas"]] == ["serving", "serving"]
        assert placed.devices == [d0, d1] and st["healing"]
        body = _health(server).json()
        assert body["status"] == "ok" and body["replicas"] == 2
        assert [c["state"] for c in body["copies"]] == ["serving", "serving"]
        assert body["copies"][0]["restored_at"] is None and body["copies"][1]["restored_at"]
        assert {q: _ask(client, q) for q in QUESTIONS} == expected  # greedy, as before


def test_a_restored_copy_reuses_what_its_lost_copy_traced(own_workers, replicated):
    """A heal places the copy afresh (new variables on the restarted worker) but traces none of
    its segments or chunk graphs again: the graphs traced for the lost copy serve the new one,
    so the serving process does not grow by a placement's traces at every heal (350 MB per
    placement of SmolLM2 over three batch sizes, when each copy traced its own). The copy on
    the other worker runs the same graphs too."""
    from tfnb.runtime.graphs import program_traces, segment_traces

    cluster, placed = replicated  # warmed: both copies traced the warm-up's shapes
    d0, d1 = cluster.devices
    prompts = [["hello"], ["the cat sat", "a b c"]]
    assert placed.replicas[1].devices == [d1]
    expected = [placed.replicas[1].generate_ids(p, max_new_tokens=8) for p in prompts]
    traced, chunks = segment_traces(), program_traces()
    assert traced > 0 and chunks > 0
    assert [placed.replicas[0].generate_ids(p, max_new_tokens=8) for p in prompts] == expected
    assert (segment_traces(), program_traces()) == (traced, chunks)
    own_workers.kill(1)
    own_workers.restart(1)  # the healer sees a new incarnation of task 1 and places its copy anew
    assert _until(lambda: placed.serving_status()["replicas"][1]["restored_at"], HEAL_BOUND_S)
    assert placed.devices == [d0, d1]
    restored = placed.replicas[1]
    assert restored.devices == [d1]
    # the restored copy answers as before, without tracing what the lost copy had traced
    for p, want in zip(prompts, expected):
        assert restored.generate_ids(p, max_new_tokens=8) == want
    assert (segment_traces(), program_traces()) == (traced, chunks)


def test_without_healing_a_lost_copy_stays_lost(own_workers, replicated):
    cluster, placed = replicated
    d0, d1 = cluster.devices
    try:
        with tfnb.serve(placed, warmup=False, heal=False) as server:
            assert not placed.healing
            client = _client(server)
            expected = {q: _ask(client, q) for q in QUESTIONS[:4]}
            own_workers.kill(1)
            with pytest.warns(ReplicaLostWarning, match="stays out"):
                # at once, so that one goes to the copy on task 1, finds it gone and runs again
                # on the other: all are answered
                assert _concurrently(client, QUESTIONS[:4]) == expected
            own_workers.restart(1)
            before = placed.served[d1]
            time.sleep(6.0)  # several of the healer's turns, had it been on
            assert _concurrently(client, QUESTIONS[:4]) == expected
            assert placed.served[d1] == before and placed.devices == [d0]
            st = placed.serving_status()
            assert [r["state"] for r in st["replicas"]] == ["serving", "lost"]
            assert st["replicas"][1]["restored_at"] is None and not st["healing"]
            assert _health(server).json()["copies"][1]["state"] == "lost"
    finally:
        if not own_workers.alive()[1]:
            own_workers.restart(1)
        cluster.reconnect()


def _concurrently(client, questions):
    out = {}

    def ask(q):
        out[q] = _ask(client, q)

    threads = [threading.Thread(target=ask, args=(q,), daemon=True) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_a_split_placement_answers_503_while_down_and_serves_again_once_healed(own_workers,
                                                                                own_cluster):
    model = tiny("llama")
    split = tfnb.place(model, own_cluster.devices, own_cluster)
    with tfnb.serve(split, warmup=False) as server:
        client = _client(server)
        expected = _ask(client, QUESTIONS[0])
        own_workers.kill(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplicaLostWarning)
            url = server.url + "/chat/completions"
            body = {"model": "tiny-llama", "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTIONS[0]}]}
            answers = [httpx.post(url, json=body, timeout=60) for _ in range(2)]
        for r in answers:  # the first finds the worker gone, the second that no copy serves
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "5"
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "worker_lost"
        with pytest.raises(openai.InternalServerError):
            _ask(client, QUESTIONS[0])
        assert _health(server).status_code == 503
        with pytest.warns(ReplicaRestoredWarning, match="task:1"):
            own_workers.restart(1)
            restarted = time.monotonic()
            assert _until(lambda: _health(server).status_code == 200, HEAL_BOUND_S), \
                _health(server).json()
        print(f"split placement healed {time.monotonic() - restarted:.1f} s after the restart")
        assert _ask(client, QUESTIONS[0]) == expected
        copy = _health(server).json()["copies"][0]
        assert copy["state"] == "serving" and copy["restored_at"]


def test_a_healer_never_takes_the_process_back_from_a_cluster_connected_since(own_workers):
    """A healer's turn that began before another ``connect`` must not reconnect its old cluster
    (which would make the new one's placements lost): its reconnect is refused, and the new
    cluster stays the process's, its placements serving."""
    from tfnb.cluster.connect import current
    from tfnb.errors import NotConnectedError

    from tests.conftest import _connect

    old = _connect(own_workers)
    new = _connect(own_workers)
    placed = tfnb.place(tiny("llama"), [new.devices[0]], new)
    with pytest.raises(NotConnectedError, match="another cluster was connected"):
        old.reconnect(only_if_current=True)
    assert current() is new and placed.lost is None
    assert placed.generate_ids([1, 2, 3], max_new_tokens=4)
