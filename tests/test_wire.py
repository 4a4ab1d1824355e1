"""A call on a worker (``tfnb.runtime.graphs.OnDevice``) sends its plain arguments as one tensor
and gets its results back as one (``tfnb.runtime.wire``), on a real worker: every dtype the
runtime passes survives the trip, results of shapes known only when the graph runs come back
whole, and the graph the worker runs takes one argument and gives one result."""
import numpy as np
import pytest
import tensorflow as tf

from tfnb.runtime import wire
from tfnb.runtime.graphs import OnDevice


@tf.function
def _mixed(tok_B, slot, done_B, floats_Bx2, ints_Bx2, small):
    """Results like a decode chunk's: a stack of rows only as long as ``slot`` says, scalars,
    booleans, and a nested structure."""
    rows = tf.tile(tok_B[None] + tf.cast(small[0], tf.int32), [slot, 1])
    return rows, {"slot": slot + 1, "done": tf.logical_not(done_B),
                  "mean": tf.reduce_mean(floats_Bx2, axis=1), "ints": ints_Bx2 * 2}


ARGS = (np.array([3, -1, 7], np.int32), np.int32(4), np.array([True, False, True]),
        np.array([[0.5, 1.5], [-2.0, 2.0], [1e-3, 3.0]], np.float32),
        np.array([[1, 2], [3, 4], [5, 6]], np.int64), np.array([9, -9], np.int8))


def test_a_call_on_a_worker_round_trips_every_dtype_and_a_run_time_shape(cluster):
    call = OnDevice(_mixed, cluster.devices[1])
    rows, rest = call(*ARGS)
    local_rows, local_rest = _mixed(*ARGS)
    assert isinstance(rows, np.ndarray) and rows.shape == (4, 3)
    np.testing.assert_array_equal(rows, local_rows.numpy())
    assert rest.keys() == local_rest.keys()
    for key, value in rest.items():
        assert value.dtype == local_rest[key].numpy().dtype, key
        np.testing.assert_array_equal(value, local_rest[key].numpy())
    assert rest["slot"] == 5 and np.ndim(rest["slot"]) == 0

    rows, _ = call(ARGS[0], np.int32(0), *ARGS[2:])  # no rows at all: still a (0, 3) array
    assert rows.shape == (0, 3)


def test_the_graph_a_worker_runs_takes_one_tensor_and_gives_one(cluster):
    call = OnDevice(_mixed, cluster.devices[0])
    call(*ARGS)
    (packed,) = call._packed.values()
    graph = packed.fn.get_concrete_function(tf.TensorSpec([wire.pack(ARGS).size], tf.uint8))
    assert len(graph.inputs) - len(graph.captured_inputs) == 1
    assert len(graph.outputs) == 1
    assert graph.outputs[0].dtype == tf.uint8


@pytest.mark.parametrize("args", [(tf.constant([1, 2]),), (None,), ("text",)])
def test_tensors_none_and_strings_are_not_packed(args):
    assert wire.signature(args) is None


def test_later_calls_run_the_first_graph_and_read_its_variables_as_they_are_now(cluster):
    """Calls after the first go straight to the graph it traced (tf.function's own lookup
    hashes every captured variable on each call): new values give new results, and a captured
    variable assigned between calls is read as it is then."""
    with tf.device(cluster.devices[0]):
        offset = tf.Variable(1, dtype=tf.int32)

    @tf.function
    def add(x_B, n):
        return x_B + offset * n

    call = OnDevice(add, cluster.devices[0])
    np.testing.assert_array_equal(call(np.array([1, 2], np.int32), np.int32(1)), [2, 3])
    offset.assign(10)
    np.testing.assert_array_equal(call(np.array([5, 6], np.int32), np.int32(2)), [25, 26])
    np.testing.assert_array_equal(call(np.array([0, 0, 0], np.int32), np.int32(1)), [10] * 3)
    assert call.experimental_get_tracing_count() == 2  # one graph per argument signature
