"""A script that serves a model ends with status 0, and its stderr holds nothing but the lines
TensorFlow writes when imported, however it ends: with or without closing the endpoint and the
cluster, while the warm-up still compiles, or with a stream still open.

Before tfnb joined its TensorFlow-calling threads at exit, each of these died after its last line
with SIGABRT ("terminate called after throwing an instance of ...", "FATAL: exception not
rethrown"): Python unwound a daemon thread coming back from TensorFlow's C++ code during
finalization. Real worker processes, the real SmolLM2 (its warm-up compiles long enough to be
under way at exit) and the ``openai`` client."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_START = """
import sys, threading, warnings
warnings.simplefilter("ignore")
import tfnb
from openai import OpenAI
cluster = tfnb.local(1)
placed = tfnb.place(tfnb.load_model("smollm2", progress=False), cluster.devices, cluster,
                    timeout=120.0)
server = tfnb.serve(placed)
client = OpenAI(base_url=server.url, api_key="none", timeout=120.0, max_retries=0)
def chat(**kw):
    return client.chat.completions.create(
        model=server.model, max_tokens=8,
        messages=[{"role": "user", "content": "What is the capital of France?"}], **kw)
"""

SCRIPTS = {
    "serve, chat, exit": "print(chat().choices[0].message.content, flush=True)",
    "serve, chat, close both, exit": """
print(chat().choices[0].message.content, flush=True)
server.close()
cluster.close()
""",
    "exit while the warm-up compiles": """
assert placed.scheduler.warming() > 0, "the warm-up ended before the exit: nothing is tested"
print("warming", placed.scheduler.warming(), flush=True)
""",
    "exit with a stream open": """
stream = chat(stream=True)
first = next(iter(stream))
print("streaming", first.choices[0].delta.content is not None or first.choices[0].delta.role,
      flush=True)
sys.exit(0)
""",
}

ABORT_SIGNS = ("terminate called", "FATAL", "Traceback", "Aborted", "Segmentation fault")
# What TensorFlow itself writes when it is imported, whatever the log level (absl logs every
# message to stderr until it is initialized): the only lines a serving script's stderr may hold
TF_IMPORT_LINES = ("All log messages before absl::InitializeLog()", "] oneDNN custom operations",
                   "] Could not find cuda drivers", "] failed call to cuInit",
                   "] This TensorFlow binary is optimized", "To enable the following instructions")


@pytest.mark.parametrize("ending", list(SCRIPTS))
def test_a_serving_script_exits_with_status_0(ending):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    res = subprocess.run([sys.executable, "-c", _START + SCRIPTS[ending]], capture_output=True,
                         text=True, timeout=420, env=env)
    assert res.returncode == 0, f"status {res.returncode}\n{res.stderr[-3000:]}"
    assert res.stdout.strip(), res.stderr[-3000:]
    assert [ln for ln in res.stderr.splitlines() if any(s in ln for s in ABORT_SIGNS)] == [], \
        res.stderr[-3000:]
    # nothing from tfnb, the workers or the exit (e.g. "Failed to remove function remotely")
    assert [ln for ln in res.stderr.splitlines()
            if ln.strip() and not any(s in ln for s in TF_IMPORT_LINES)] == [], res.stderr[-3000:]
