"""Models the engine tests share (imported by test modules: pytest puts tests/ on sys.path)."""
import jax
import numpy as np
from flax import nnx

from rstarjax.models.qwen3 import Qwen3


def chaotic(model: Qwen3, seed: int, scale: float = 0.35) -> Qwen3:
    """``model`` with large random weights, so greedy continuations vary (a freshly initialised
    tiny model tends to repeat one token, which would make token comparisons weak) and a KV
    page read before it is written changes the next token."""
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    leaves = [np.asarray(jax.random.normal(k, x.shape, x.dtype)) * scale
              for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
