"""The endpoint's request checking and response shapes on plain dicts: no workers, no server.

Every refused field is a 400 whose message quotes the value and says what would be accepted,
and whose error object names the field, as OpenAI's API does."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tfnb.serving.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_BODY_BYTES,
    ApiError,
    ChatRequest,
    Chunks,
    CompletionRequest,
    chat_prompt,
    check_size,
    completion,
    finish,
    parse_body,
    parse_chat,
    parse_completion,
    usage,
)

CTX = 512
HI = [{"role": "user", "content": "hi"}]


def _chat(**fields):
    return parse_chat({"model": "m", "messages": HI, **fields}, CTX)


def test_a_plain_chat_body_is_greedy_or_sampled_by_temperature():
    greedy = _chat(temperature=0, max_tokens=8)
    assert greedy == ChatRequest(messages=HI, options={"max_new_tokens": 8, "stop": None})
    sampled = _chat(temperature=0.7, top_p=0.9, seed=4, stop=["\n", "END"])
    assert sampled.options == {"max_new_tokens": DEFAULT_MAX_TOKENS, "stop": ["\n", "END"],
                               "do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 4}
    assert not sampled.stream and not sampled.include_usage


def test_text_parts_join_by_lines_and_roles_are_kept():
    req = parse_chat({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"},
                                     {"type": "text", "text": "lo"}]},
    ]}, CTX)
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hel\nlo"}]


def test_nulls_and_left_out_values_mean_the_apis_defaults():
    req = _chat(max_tokens=None, n=None, top_p=None, stop=None, temperature=None, seed=None,
                stream=None, logprobs=False, top_logprobs=0, tools=[], functions=None,
                echo=False, suffix="", logit_bias={}, presence_penalty=0,
                frequency_penalty=0.0, best_of=1, response_format={"type": "text"})
    assert req.options["max_new_tokens"] == DEFAULT_MAX_TOKENS and req.options["do_sample"]
    assert req.options["temperature"] == 1.0 and req.options["top_p"] == 1.0
    assert _chat(stop=[], temperature=0).options["stop"] is None
    assert _chat(stop="x", temperature=0).options["stop"] == ["x"]


def test_max_completion_tokens_wins_over_max_tokens_unless_null():
    assert _chat(max_tokens=5, max_completion_tokens=7).options["max_new_tokens"] == 7
    assert _chat(max_tokens=5, max_completion_tokens=None).options["max_new_tokens"] == 5
    with pytest.raises(ApiError, match="max_completion_tokens=0") as e:
        _chat(max_tokens=5, max_completion_tokens=0)
    assert e.value.param == "max_completion_tokens"


def test_a_completion_prompt_is_a_string_or_a_list_of_one():
    req = parse_completion({"prompt": ["the cat"], "temperature": 0, "max_tokens": 3}, CTX)
    assert req == CompletionRequest(prompt="the cat", options={"max_new_tokens": 3, "stop": None})
    assert parse_completion({"prompt": "dog"}, CTX).prompt == "dog"


def test_streaming_and_its_usage_option():
    assert (_chat(stream=True).stream, _chat(stream=True).include_usage) == (True, False)
    req = _chat(stream=True, stream_options={"include_usage": True})
    assert req.stream and req.include_usage
    assert not _chat(stream=False, stream_options="ignored when not streaming").include_usage


SURROGATE = json.loads('"a\\ud800"')  # JSON escapes can carry a lone surrogate

# (field values, the param named, words the message must hold: the value and what is accepted)
REFUSED = [
    ({"n": 2}, "n", ["n=2", "expected 1"]),
    ({"n": True}, "n", ["n=True", "expected 1"]),
    ({"logprobs": True}, "logprobs", ["logprobs=True", "expected it left out"]),
    ({"logprobs": 0}, "logprobs", ["logprobs=0", "expected it left out"]),
    ({"top_logprobs": 2}, "top_logprobs", ["top_logprobs=2", "left out"]),
    ({"tools": [{"type": "function"}]}, "tools", ["tools=[", "left out"]),
    ({"functions": [{"name": "f"}]}, "functions", ["functions=[", "left out"]),
    ({"echo": True}, "echo", ["echo=True", "left out"]),
    ({"suffix": "end"}, "suffix", ["suffix='end'", "left out"]),
    ({"logit_bias": {"1": 5}}, "logit_bias", ["logit_bias=", "left out"]),
    ({"presence_penalty": 0.5}, "presence_penalty", ["presence_penalty=0.5", "left out"]),
    ({"frequency_penalty": 1}, "frequency_penalty", ["frequency_penalty=1", "left out"]),
    ({"best_of": 3}, "best_of", ["best_of=3", "left out"]),
    ({"response_format": {"type": "json_object"}}, "response_format",
     ["response_format=", "{'type': 'text'}"]),
    ({"response_format": "text"}, "response_format", ["response_format='text'", "'text'"]),
    ({"max_tokens": 0}, "max_tokens", ["max_tokens=0", "from 1 to 511"]),
    ({"max_tokens": CTX}, "max_tokens", [f"max_tokens={CTX}", "from 1 to 511"]),
    ({"max_tokens": True}, "max_tokens", ["max_tokens=True", "an integer"]),
    ({"max_tokens": 2.5}, "max_tokens", ["max_tokens=2.5", "an integer"]),
    ({"max_tokens": "8"}, "max_tokens", ["max_tokens='8'", "an integer"]),
    ({"temperature": 9}, "temperature", ["temperature=9", "from 0 to 2"]),
    ({"temperature": -0.1}, "temperature", ["temperature=-0.1", "from 0 to 2"]),
    ({"temperature": "hot"}, "temperature", ["temperature='hot'", "a number"]),
    ({"temperature": 0, "top_p": 5}, "top_p", ["top_p=5", "at most 1"]),
    ({"top_p": 0}, "top_p", ["top_p=0", "above 0"]),
    ({"top_p": "x"}, "top_p", ["top_p='x'", "a number"]),
    ({"seed": "x"}, "seed", ["seed='x'", "an integer"]),
    ({"seed": 1.5}, "seed", ["seed=1.5", "an integer"]),
    ({"seed": False}, "seed", ["seed=False", "an integer"]),
    ({"stop": list("abcde")}, "stop", ["stop=[", "up to 4"]),
    ({"stop": 0}, "stop", ["stop=0", "a non-empty string"]),
    ({"stop": [""]}, "stop", ["stop=['']", "a non-empty string"]),
    ({"stop": ""}, "stop", ["stop=''", "a non-empty string"]),
    ({"stop": [SURROGATE]}, "stop", ["stop=[", "a non-empty string"]),
    ({"stream": "no"}, "stream", ["stream='no'", "true or false"]),
    ({"stream": 1}, "stream", ["stream=1", "true or false"]),
    ({"stream": True, "stream_options": "usage"}, "stream_options",
     ["stream_options='usage'", "include_usage"]),
    ({"messages": "hi"}, "messages", ["messages='hi'", "a non-empty list"]),
    ({"messages": None}, "messages", ["messages=None", "a non-empty list"]),
    ({"messages": []}, "messages", ["messages=[]", "a non-empty list"]),
    ({"messages": ["hi"]}, "messages", ["messages=['hi']", "{'role': str"]),
    ({"messages": [{"content": "hi"}]}, "messages", ["messages=", "'role': str"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", ["messages=", "a list of text parts"]),
    ({"messages": [{"role": "user", "content": SURROGATE}]}, "messages",
     ["messages=", "valid Unicode"]),
    ({"messages": [{"role": "user", "content": 7}]}, "messages", ["messages=", "content"]),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]},
     "messages[1].role", ["messages[1].role='wizard'", "'user'", "'assistant'"]),
]


@pytest.mark.parametrize("fields, param, words", REFUSED,
                         ids=[f"{p}={str(list(f.values())[-1])[:20]}" for f, p, _ in REFUSED])
def test_each_refused_field_is_a_400_naming_it_and_what_is_accepted(fields, param, words):
    with pytest.raises(ApiError) as e:
        _chat(**fields)
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param",
                                                                   "code"}
    assert all(w in err["message"] for w in words), (words, err["message"])


@pytest.mark.parametrize("prompt", [["a", "b"], [], 7, "", None, [SURROGATE], {"text": "a"}])
def test_a_completion_prompt_that_is_not_one_string_is_refused(prompt):
    with pytest.raises(ApiError, match=r"expected a non-empty str") as e:
        parse_completion({"prompt": prompt}, CTX)
    assert e.value.status == 400 and e.value.param == "prompt"
    assert e.value.body()["error"]["message"].startswith(f"prompt={prompt!r:.20}")


def test_the_completion_endpoint_refuses_the_same_sampling_fields():
    with pytest.raises(ApiError, match="echo=True"):
        parse_completion({"prompt": "a", "echo": True}, CTX)
    with pytest.raises(ApiError, match="stream=1"):
        parse_completion({"prompt": "a", "stream": 1}, CTX)


def test_the_first_bad_field_is_the_one_named():
    """Form (n, logprobs ...) first, then lengths and sampling, then the messages, then stream."""
    with pytest.raises(ApiError, match="n=3"):
        parse_chat({"messages": "x", "n": 3, "max_tokens": 0}, CTX)
    with pytest.raises(ApiError, match="max_tokens=0"):
        parse_chat({"messages": "x", "max_tokens": 0, "stream": "y"}, CTX)
    with pytest.raises(ApiError, match="messages='x'"):
        parse_chat({"messages": "x", "stream": "y"}, CTX)


def test_bodies_that_are_not_a_json_object_for_this_model():
    assert parse_body(b'{"model": "m", "prompt": "a"}', "m") == {"model": "m", "prompt": "a"}
    cases = [(b"{not json", 400, "not JSON", None),
             (b"[" * 100_000, 400, "nested too deeply", None),
             (b"[1, 2]", 400, "is list: expected an object", None),
             (b"\xff\xfe{", 400, "not JSON", None),
             (b'{"model": "gpt-4"}', 404, "model 'gpt-4' does not exist", "model_not_found"),
             (b'{"prompt": "a"}', 404, "model None", "model_not_found")]
    for raw, status, words, code in cases:
        with pytest.raises(ApiError) as e:
            parse_body(raw, "m")
        assert (e.value.status, e.value.code) == (status, code) and words in str(e.value), raw[:20]
    check_size(MAX_BODY_BYTES)
    with pytest.raises(ApiError, match="over 8 MB") as e:
        check_size(MAX_BODY_BYTES + 1)
    assert e.value.status == 413 and e.value.code == "body_too_large"


def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_them():
    from jinja2.exceptions import TemplateError

    class Strict:
        def apply_chat_template(self, messages):
            raise TemplateError("Conversation roles must alternate user/assistant")

    class Echo:
        def apply_chat_template(self, messages):
            return "|".join(m["content"] for m in messages)

    with pytest.raises(ApiError, match="roles must alternate") as e:
        chat_prompt(Strict(), HI * 2)
    assert e.value.status == 400 and e.value.param == "messages"
    assert chat_prompt(Echo(), _chat().messages * 2) == "hi|hi"


def test_whole_answers_and_their_usage():
    events = [SimpleNamespace(rows_stopped=[False], n_tokens=2),
              SimpleNamespace(rows_stopped=[True], n_tokens=5)]
    assert finish(events) == ("stop", 5) and finish(events[:1]) == ("length", 2)
    assert finish([]) == ("length", 0)
    chat = completion(True, "m", "Paris.", "stop", usage(9, 5))
    assert chat["id"].startswith("chatcmpl-") and chat["object"] == "chat.completion"
    assert chat["model"] == "m" and chat["usage"] == {"prompt_tokens": 9, "completion_tokens": 5,
                                                      "total_tokens": 14}
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                "finish_reason": "stop"}]
    text = completion(False, "m", "sat", "length", usage(2, 1))
    assert text["id"].startswith("cmpl-") and text["object"] == "text_completion"
    assert text["choices"] == [{"index": 0, "text": "sat", "finish_reason": "length",
                                "logprobs": None}]


def _data(event: str):
    assert event.startswith("data: ") and event.endswith("\n\n"), event
    return json.loads(event[len("data: "):])


def test_streamed_chunks_share_an_id_and_carry_usage_only_when_asked():
    chunks = Chunks("m", chat=True, include_usage=True)
    first, piece, last = (_data(chunks.piece("", first=True)), _data(chunks.piece("Par")),
                          _data(chunks.piece(None, "stop")))
    assert {first["id"], piece["id"], last["id"]} == {chunks.id}
    assert chunks.id.startswith("chatcmpl-") and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"content": "", "role": "assistant"}
    assert piece["choices"] == [{"index": 0, "delta": {"content": "Par"}, "finish_reason": None}]
    assert last["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert first["usage"] is None and piece["usage"] is None
    closing = _data(chunks.usage(usage(3, 1)))
    assert closing["choices"] == [] and closing["usage"]["total_tokens"] == 4
    assert chunks.DONE == "data: [DONE]\n\n"
    plain = Chunks("m", chat=False)
    text = _data(plain.piece("cat"))
    assert "usage" not in text and text["object"] == "text_completion"
    assert text["choices"] == [{"index": 0, "text": "cat", "finish_reason": None,
                                "logprobs": None}]
    assert plain.id.startswith("cmpl-") and plain.id != Chunks("m", chat=False).id
    err = _data(Chunks.error(ApiError(503, "stalled", "server_error", code="worker_lost")))
    assert err == {"error": {"message": "stalled", "type": "server_error", "param": None,
                             "code": "worker_lost"}}


def test_the_protocol_needs_neither_the_http_stack_nor_tensorflow():
    code = ("import sys, tfnb.serving.protocol; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'starlette', 'uvicorn', 'anyio', 'tensorflow', 'IPython', 'ipywidgets'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_public_names_import_from_tfnb_serving():
    import tfnb
    from tfnb.serving import ExposedEndpointWarning, ServeError, Server

    assert tfnb.serve is tfnb.serving.serve and tfnb.Server is Server
    assert issubclass(ServeError, ValueError) and issubclass(ExposedEndpointWarning, UserWarning)


def test_docstring_examples_run():
    import doctest

    import tfnb.serving.protocol as mod

    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
