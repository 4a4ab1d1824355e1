"""SmolLM2 packed over two plain ``tf.distribute.Server``s started as the TensorFlow recipe does
(no ``tfnb worker``, so no tfnb kernels): the XLA route holds its weights compact and answers
with the float32 path's greedy tokens."""
import warnings

import numpy as np
import pytest

import tfnb

from tests.plain_servers import plain_servers

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Once upon a time, a small robot"]


def held_bytes(placed) -> int:
    return sum(int(np.prod(v.shape)) * v.dtype.size for v in placed.variables)


def test_smollm2_split_over_two_plain_servers():
    with plain_servers(2) as addresses:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster = tfnb.connect(addresses, timeout=30.0)
        packed = tfnb.load_model("smollm2", progress=False)
        placed = tfnb.place(packed, cluster.devices, cluster)
        assert len(set(placed.assignment.values())) == 2
        assert set(placed.stage_routes.values()) == {"xla"}
        assert placed.route_summary() == "worker:0/CPU:0 xla, worker:1/CPU:0 xla"

        floats = tfnb.load_model("smollm2", weights="float32", progress=False)
        reference = tfnb.place(floats, cluster.devices, cluster)
        assert set(reference.stage_routes.values()) == {"float32"}
        # the file's Q4_1 and Q8_0 blocks, held in their own bytes (the float32 path: 538 MB)
        assert held_bytes(placed) <= 0.35 * held_bytes(reference)
        for prompt in PROMPTS:
            assert placed.generate_ids(prompt, max_new_tokens=24) == \
                reference.generate_ids(prompt, max_new_tokens=24), prompt
        # a batch of prompts (rows multiply the dequantized matrices) gives each row's tokens
        batch = placed.generate_ids(PROMPTS[:3], max_new_tokens=8)
        assert batch == [reference.generate_ids(p, max_new_tokens=8) for p in PROMPTS[:3]]
        assert "Paris" in placed.chat("What is the capital of France?", max_new_tokens=10)


def test_route_choices_are_checked_and_reported(local_workers):
    """On ``tfnb worker``s the kernel is the default; ``route="xla"`` (for all, or one worker)
    is honoured and gives the same greedy tokens; a bad route is one clear error."""
    from tfnb.errors import PlacementError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = tfnb.connect(local_workers)
    model = tfnb.load_model("smollm2", progress=False)
    with pytest.raises(PlacementError, match=r"route='fast'.*'auto', 'kernel', 'xla'"):
        tfnb.place(model, cluster.devices, cluster, route="fast")
    with pytest.raises(PlacementError, match=r"route='gpu'"):
        tfnb.place(model, cluster.devices, cluster, route={"worker:1": "gpu"})
    with pytest.raises(PlacementError, match=r"route key 'worker:7' names no worker.*'worker:1'"):
        tfnb.place(model, cluster.devices, cluster, route={"worker:7": "xla"})
    kernel = tfnb.place(model, cluster.devices, cluster)
    assert set(kernel.stage_routes.values()) == {"kernel"}
    mixed = tfnb.place(model, cluster.devices, cluster, route={"worker:1": "xla"})
    assert mixed.routes == {cluster.devices[0]: "kernel", cluster.devices[1]: "xla"}
    assert "worker:1/CPU:0 xla" in repr(mixed)
    for prompt in PROMPTS[:2]:
        assert mixed.generate_ids(prompt, max_new_tokens=16) == \
            kernel.generate_ids(prompt, max_new_tokens=16), prompt
