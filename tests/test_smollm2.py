"""SmolLM2-135M over real workers, its weights packed as the GGUF file holds them, gives Hugging
Face's greedy tokens (computed from the dequantized float32 weights), on one worker and on two."""
import warnings

import numpy as np
import pytest

import tfnb

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2():
    return tfnb.load_model("smollm2", progress=False)


def test_greedy_tokens_match_hf_on_one_and_two_workers(smollm2, local_workers):
    import tensorflow as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = tfnb.connect(local_workers)
    tok = smollm2.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    hf = smollm2.to_hf()
    want = hf.generate(tf.constant([ids]), max_new_tokens=10, do_sample=False, pad_token_id=2)
    want = want[0, len(ids):].numpy().tolist()
    del hf
    assert smollm2.packed
    two = tfnb.place(smollm2, tfnb.plan(smollm2, cluster, max_memory="100MB"), cluster)
    assert len(set(two.assignment.values())) == 2
    held = sum(int(np.prod(v.shape)) * v.dtype.size for v in two.variables)
    assert held < 130e6  # packed: 92 MB plus the tied embedding on both ends (float32: 538 MB)
    assert two.generate_ids(ids, max_new_tokens=10) == want
    assert "Paris" in two.chat(QUESTION, max_new_tokens=10)
    one = tfnb.place(smollm2, [cluster.devices[1]], cluster, previous=None)
    assert one.generate_ids(ids, max_new_tokens=10) == want
