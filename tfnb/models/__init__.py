"""Models tfnb can run: llama-family weights as numpy arrays, or opaque HF / Keras models.

Examples
--------
>>> from tfnb.models import tiny
>>> tiny("llama").chain.names
['embed', 'block.0', 'block.1', 'head']
"""

from tfnb.models.chain import LayerChain, Stage
from tfnb.models.decoder import LlamaConfig, random_weights, tiny_config
from tfnb.models.describe import FILE_TYPES, describe_model
from tfnb.models.model import MODEL_NAMES, Model, load_model, tiny
from tfnb.models.tokenizer import CharTokenizer, Tokenizer

__all__ = [
    "CharTokenizer",
    "FILE_TYPES",
    "LayerChain",
    "LlamaConfig",
    "MODEL_NAMES",
    "Model",
    "Stage",
    "Tokenizer",
    "describe_model",
    "load_model",
    "random_weights",
    "tiny",
    "tiny_config",
]
