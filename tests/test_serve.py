"""The OpenAI-compatible endpoint, driven by the official ``openai`` client over real HTTP on
127.0.0.1, over real workers: concurrent chats, streaming, disconnects, bad requests, keys."""
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the endpoint tests drive it with the openai client")

import tfnb
from tfnb.models import tiny
from tfnb.serving import ServeError, serve

from tests.conftest import _connect

QUESTIONS = ["hello", "what is two", "the cat sat", "a b c", "good day", "tell me", "why", "x"]


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def _placements(cluster, model):
    """The tiny model split over both workers, and replicated on both."""
    split = tfnb.place(model, cluster.devices, cluster)
    replicated = tfnb.place(model, tfnb.plan(model, cluster, mode="replicate", calibrate=False),
                            cluster)
    return {"split": split, "replicated": replicated}


@pytest.fixture(scope="module")
def placements(own_workers, model):
    """Placed once for the module (placing and compiling are most of this suite's time): no
    test here stops a worker or changes the model, and each leaves its rows free. Only the
    first test serves with the default background warmup; the others serve with
    ``warmup=False``, so that no compilation left over from one slows the next."""
    return _placements(_connect(own_workers), model)


@pytest.fixture
def fresh_placements(own_cluster, model):
    """Placed for the one test that counts what compiles from nothing."""
    return _placements(own_cluster, model)


def _client(server, key="none"):
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def _ask(client, name, question, **kw):
    kw = {"temperature": 0, **kw}
    out = client.chat.completions.create(model=name, max_tokens=16,
                                         messages=[{"role": "user", "content": question}], **kw)
    return out.choices[0].message.content


@pytest.mark.parametrize("layout", ["replicated", "split"])
def test_concurrent_chats_get_the_same_greedy_answers_as_one_at_a_time(placements, layout):
    placed = placements[layout]
    served = dict(placed.served) if layout == "replicated" else None
    with serve(placed) as server:
        client = _client(server)
        alone = {q: _ask(client, server.model, q) for q in QUESTIONS}
        assert alone == {q: placed.chat(q, max_new_tokens=16) for q in QUESTIONS}
        got, threads = {}, []
        for q in QUESTIONS:
            threads.append(threading.Thread(
                target=lambda q=q: got.update({q: _ask(client, server.model, q)})))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == alone
    if layout == "replicated":
        assert all(placed.served[d] > n for d, n in served.items()), (served, placed.served)


def test_streaming_gives_the_whole_answer_in_pieces(placements):
    placed = placements["replicated"]
    with serve(placed, warmup=False) as server:
        client = _client(server)
        stream = client.chat.completions.create(
            model=server.model, temperature=0, max_tokens=24, stream=True,
            messages=[{"role": "user", "content": "hello"}])
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == placed.chat("hello", max_new_tokens=24)
        ids = placed.generate_ids(placed.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello"}]), max_new_tokens=24)
        reason = "stop" if ids[-1] in placed.eos_ids else "length"
        assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == reason
        done = client.completions.create(model=server.model, prompt="the cat", temperature=0,
                                         max_tokens=8)
        assert done.choices[0].text == placed.generate("the cat", max_new_tokens=8)
        assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
        stop = done.choices[0].text[3:5]  # a stop string cuts the text there, and says so
        cut = client.completions.create(model=server.model, prompt="the cat", temperature=0,
                                        max_tokens=8, stop=[stop])
        assert cut.choices[0].text == done.choices[0].text[:done.choices[0].text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_the_apis_optional_forms_text_parts_nulls_and_streamed_usage(placements):
    placed = placements["replicated"]
    hello = [{"role": "user", "content": "hello"}]
    with serve(placed, warmup=False) as server:
        client = _client(server)
        whole = client.chat.completions.create(model=server.model, temperature=0, max_tokens=12,
                                               messages=hello)
        parts = client.chat.completions.create(model=server.model, temperature=0, max_tokens=12,
                                               messages=[{"role": "user", "content": [
                                                   {"type": "text", "text": "hel"},
                                                   {"type": "text", "text": "lo"}]}])
        lines = client.chat.completions.create(model=server.model, temperature=0, max_tokens=12,
                                               messages=[{"role": "user", "content": "hel\nlo"}])
        assert parts.choices[0].message.content == lines.choices[0].message.content
        chunks = list(client.chat.completions.create(
            model=server.model, temperature=0, max_tokens=12, messages=hello, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == \
            whole.choices[0].message.content
        # JSON null is the API's default: 64 new tokens at most, one choice, top_p 1
        r = httpx.post(server.url + "/completions", timeout=60, json={
            "model": server.model, "prompt": "the cat", "temperature": 0, "max_tokens": None,
            "n": None, "top_p": None, "stop": None})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == placed.generate("the cat", max_new_tokens=64)
        # a prompt list of one, as LangChain's legacy OpenAI sends it; max_tokens behind a null
        listed = client.completions.create(model=server.model, prompt=["the cat"], temperature=0,
                                           max_tokens=5, extra_body={"max_completion_tokens": None})
        assert listed.choices[0].text == placed.generate("the cat", max_new_tokens=5)
        assert listed.usage.completion_tokens == 5


def test_a_client_that_disconnects_mid_stream_frees_its_replica(placements):
    placed = placements["replicated"]
    with serve(placed, warmup=False) as server:
        with httpx.stream("POST", server.url + "/chat/completions", timeout=30, json={
                "model": server.model, "temperature": 0, "max_tokens": 200, "stream": True,
                "messages": [{"role": "user", "content": "hello"}]}) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the first event, then hang up
        deadline = time.monotonic() + 20
        while sum(placed.in_flight.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(placed.in_flight.values()) == 0, placed.in_flight
        while any(sum(r.scheduler.busy_rows()) for r in placed.replicas) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert [r.scheduler.busy_rows() for r in placed.replicas] == [[0], [0]]  # rows freed
        assert _ask(_client(server), server.model, "hello")  # and it serves again


@pytest.mark.parametrize("body, status, word", [
    (b"{not json", 400, "not JSON"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "'gpt-4'"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens=0"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400,
     "max_tokens=1000000"),
    ({"model": "MODEL", "messages": "hi"}, 400, "messages='hi'"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400,
     "temperature=9"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n=2"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "best_of": 3}, 400,
     "best_of=3"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400,
     "logprobs=True"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}}, 400, "response_format="),
    ({"model": "MODEL", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages="),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "stream": True,
      "stream_options": "usage"}, 400, "stream_options='usage'"),
])
def test_bad_requests_get_the_apis_json_error(placements, body, status, word):
    with serve(placements["split"], warmup=False) as server:
        if isinstance(body, dict) and body.get("model") == "MODEL":
            body = {**body, "model": server.model}
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + "/chat/completions", timeout=30, **kw)
        assert r.status_code == status and word in r.json()["error"]["message"], r.text
        assert httpx.get(server.url + "/nope", timeout=5).status_code == 404


def test_more_bad_requests_each_get_one_json_error_and_the_server_keeps_serving(placements):
    """Types and ranges of every field the endpoint reads, bodies that are not a JSON object
    (nested past Python's recursion limit, over the size limit), text that is not valid
    Unicode, routes and methods: each a 4xx with the API's error object."""
    hi = [{"role": "user", "content": "hi"}]
    with serve(placements["split"], warmup=False) as server:
        chat, name = server.url + "/chat/completions", server.model
        cases = [
            (chat, b"[" * 100_000, 400, "nested too deeply"),
            (chat, b"[1, 2]", 400, "is list: expected an object"),
            (chat, b"{" + b" " * (9 << 20) + b"}", 413, "over 8 MB"),
            (chat, b'{"model": "MODEL", "messages": [{"role": "user", "content": "a\\ud800"}]}',
             400, "valid Unicode"),
            (chat, {"messages": hi}, 404, "model None"),
            (chat, {"model": "MODEL"}, 400, "messages=None"),
            (chat, {"model": "MODEL", "messages": []}, 400, "messages=[]"),
            (chat, {"model": "MODEL", "messages": hi, "max_tokens": True}, 400, "max_tokens=True"),
            (chat, {"model": "MODEL", "messages": hi, "max_tokens": 2.5}, 400, "max_tokens=2.5"),
            (chat, {"model": "MODEL", "messages": hi, "max_tokens": "8"}, 400, "max_tokens='8'"),
            (chat, {"model": "MODEL", "messages": hi, "stream": "no"}, 400, "stream='no'"),
            (chat, {"model": "MODEL", "messages": hi, "stream": 1}, 400, "stream=1"),
            (chat, {"model": "MODEL", "messages": hi, "stop": list("abcde")}, 400, "stop=["),
            (chat, {"model": "MODEL", "messages": hi, "stop": 0}, 400, "stop=0"),
            (chat, {"model": "MODEL", "messages": hi, "stop": [""]}, 400, "stop=['']"),
            (chat, {"model": "MODEL", "messages": hi, "temperature": 0, "top_p": 5}, 400,
             "top_p=5"),
            (chat, {"model": "MODEL", "messages": hi, "temperature": 0, "top_p": "x"}, 400,
             "top_p='x'"),
            (chat, {"model": "MODEL", "messages": hi, "seed": "x"}, 400, "seed='x'"),
            (server.url + "/completions", {"model": "MODEL", "prompt": ["a", "b"]}, 400,
             "prompt=['a', 'b']"),
            (server.url + "/completions", {"model": "MODEL", "prompt": 7}, 400, "prompt=7"),
        ]
        for url, body, status, word in cases:
            if isinstance(body, dict) and body.get("model") == "MODEL":
                body = {**body, "model": name}
            kw = {"content": body.replace(b"MODEL", name.encode())} if isinstance(body, bytes) \
                else {"json": body}
            r = httpx.post(url, timeout=30, **kw)
            assert r.status_code == status and word in r.json()["error"]["message"], (body, r.text)
        r = httpx.get(chat, timeout=5)
        assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/embeddings", timeout=5, json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert _ask(_client(server), name, "hi") == placements["split"].chat("hi",
                                                                              max_new_tokens=16)


def test_a_key_is_checked_on_every_request_and_needed_beyond_loopback(placements):
    placed = placements["split"]
    with pytest.raises(ServeError, match="api_key"):
        serve(placed, host="0.0.0.0")
    with pytest.raises(ServeError, match="port=-1"):
        serve(placed, port=-1)
    with serve(placed, api_key="s3cret", warmup=False) as server:
        with pytest.raises(openai.AuthenticationError):
            _ask(_client(server, key="wrong"), server.model, "hi")
        assert httpx.get(server.url + "/models", timeout=5).status_code == 401
        assert _ask(_client(server, key="s3cret"), server.model, "hi") == \
            placed.chat("hi", max_new_tokens=16)
        models = _client(server, key="s3cret").models.list()
        assert [m.id for m in models.data] == [server.model]
        health = server.url.removesuffix("/v1") + "/health"
        assert httpx.get(health, timeout=5).status_code == 401
        assert httpx.get(health, timeout=5, headers={"Authorization": "Bearer s3cret"}).json()[
            "status"] == "ok"


def _health(server):
    return httpx.get(server.url.removesuffix("/v1") + "/health", timeout=5).json()


def test_the_endpoint_compiles_ahead_so_a_burst_compiles_nothing(fresh_placements):
    """By default the endpoint compiles every batch, window and prompt bucket of greedy and
    sampled requests in the background (``/health`` counts what is left); a burst after that
    compiles nothing. ``warmup=False`` queues nothing, and closing drops what is queued."""
    placed, split = fresh_placements["replicated"], fresh_placements["split"]
    with serve(placed) as server:
        assert _health(server)["warming"] > 0
        client = _client(server)
        assert _ask(client, server.model, "hi") == placed.chat("hi", max_new_tokens=16)
        deadline = time.monotonic() + 300
        while _health(server)["warming"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _health(server)["warming"] == 0
        before = [r.compiles for r in placed.replicas]
        got, threads = {}, []
        for i, q in enumerate(QUESTIONS):  # half greedy, half sampled
            kw = {} if i % 2 else {"temperature": 0.8, "seed": i}
            threads.append(threading.Thread(target=lambda q=q, kw=kw: got.update(
                {q: _ask(client, server.model, q, **kw)})))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(got) == sorted(QUESTIONS) and all(isinstance(a, str) for a in got.values())
        assert [r.compiles for r in placed.replicas] == before
    with serve(split, warmup=False) as server:
        assert _health(server)["warming"] == 0
    server = serve(split)
    server.close()
    assert split.scheduler.warming() <= 2  # at most each lane's compiling shape
    deadline = time.monotonic() + 60  # the shape compiling when it closed finishes
    while split.scheduler.warming() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert split.scheduler.warming() == 0
    with pytest.raises(ServeError, match="warmup='yes'"):
        serve(placed, warmup="yes")


def test_a_chat_template_that_refuses_the_messages_is_a_bad_request():
    """HF chat templates raise (jinja's ``raise_exception``) on conversations they do not take,
    e.g. roles that do not alternate: a 400 naming the messages, not a 500."""
    from jinja2.exceptions import TemplateError

    from tfnb.serving.protocol import ApiError, chat_prompt

    class Strict:
        def apply_chat_template(self, messages):
            raise TemplateError("Conversation roles must alternate user/assistant")

    with pytest.raises(ApiError, match="roles must alternate") as e:
        chat_prompt(Strict(), [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.status == 400 and e.value.param == "messages"


ROUNDS, WARM_ROUNDS = 60, 20
# Resident memory allowed to come and go between two samples (allocators' pools): measured
# here, the serving process and each worker grew by 1-2 MB per 50 rounds after the warm ones,
# where a request that kept 50 KB would add 24 MB over these rounds.
GROWTH_LIMIT_MB = 12


def test_memory_stays_flat_over_rounds_of_the_same_requests(own_workers, fresh_placements):
    """Once every shape a workload meets is compiled, serving it again and again holds the
    serving process's and the workers' memory: what a finished request held is freed, and
    what is cached per shape is not made again. Rounds of 8 concurrent clients (plain and
    streamed chats, and a hang-up) through the endpoint; resident memory after the warm
    rounds against after the rest."""
    import gc

    import psutil

    placed = fresh_placements["replicated"]  # the module's were lost to a later connect
    placed.warmup(prompt_tokens=32)  # every shape compiled: what is cached per shape is made
    processes = {"serving process": psutil.Process(),
                 **{f"worker {i}": psutil.Process(p) for i, p in enumerate(own_workers.pids)}}

    def rss():
        gc.collect()
        return {k: p.memory_info().rss / 2**20 for k, p in processes.items()}

    with serve(placed, warmup=False) as server:
        client = _client(server)

        def one(i):
            q = QUESTIONS[i % len(QUESTIONS)]
            if i % 3 == 0:
                return _ask(client, server.model, q)
            stream = client.chat.completions.create(
                model=server.model, max_tokens=24, temperature=0, stream=True,
                messages=[{"role": "user", "content": q}])
            with stream:
                for k, _ in enumerate(stream):
                    if i % 3 == 2 and k == 2:
                        break  # hangs up
            return "done"

        def round_():
            threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)

        for _ in range(WARM_ROUNDS):
            round_()
        before = rss()
        for _ in range(ROUNDS):
            round_()
        after = rss()
    grown = {k: after[k] - before[k] for k in before}
    print("resident MB before, after:", {k: (round(before[k]), round(after[k])) for k in before})
    assert all(g < GROWTH_LIMIT_MB for g in grown.values()), grown
