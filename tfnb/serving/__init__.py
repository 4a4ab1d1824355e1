"""An OpenAI-compatible HTTP endpoint over a placed model, served from the notebook's kernel.

``tfnb.serve(placed)`` starts a Starlette app under uvicorn in a background thread:
``/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events when asked),
``/v1/models`` and ``/health``. Any OpenAI client can talk to it, many at once. Bad requests get
the API's JSON error and a 4xx.

Two modules, one idea each: :mod:`tfnb.serving.protocol` is the API as data (checked requests,
error bodies, response shapes; no HTTP stack), :mod:`tfnb.serving.server` the routes, the
uvicorn thread and ``serve``.

Examples
--------
>>> server = tfnb.serve(placed)                                    # doctest: +SKIP
>>> from openai import OpenAI                                      # doctest: +SKIP
>>> client = OpenAI(base_url=server.url, api_key="none")           # doctest: +SKIP
>>> client.chat.completions.create(model=server.model, messages=[  # doctest: +SKIP
...     {"role": "user", "content": "What is the capital of France?"}]).choices[0].message.content
'The capital of France is Paris.'
"""

from tfnb.serving.protocol import ApiError, ChatRequest, CompletionRequest, chat_prompt
from tfnb.serving.server import ExposedEndpointWarning, ServeError, Server, serve

__all__ = ["serve", "Server", "ServeError", "ExposedEndpointWarning", "ApiError", "ChatRequest",
           "CompletionRequest", "chat_prompt"]
