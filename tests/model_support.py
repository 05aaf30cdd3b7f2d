"""Models the engine tests share (imported by test modules: pytest puts tests/ on sys.path)."""
import jax
import jax.numpy as jnp
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


# ---- the outside reference of engine tests: the uncached forward, a pool full of junk ----------

_forward = jax.jit(lambda state, tokens, graphdef: nnx.merge(graphdef, state)(tokens),
                   static_argnums=(2,))


def full_forward_logprobs(model: Qwen3, convos: list[list[int]], *, rows: int,
                          width: int) -> list[np.ndarray]:
    """log_softmax (float64) of the model's uncached training forward over each whole
    conversation, ``rows`` conversations per call right-padded to ``width`` tokens (one compiled
    shape; attention is causal: padding after a conversation cannot change its logits)."""
    graphdef, state = nnx.split(model)
    out = []
    for i in range(0, len(convos), rows):
        chunk = convos[i:i + rows]
        tokens = np.zeros((rows, width), np.int32)
        for j, c in enumerate(chunk):
            tokens[j, : len(c)] = c
        logits = np.asarray(_forward(state, jnp.asarray(tokens), graphdef), np.float64)
        m = logits.max(-1, keepdims=True)
        lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        out += [lp[j, : len(c)] for j, c in enumerate(chunk)]
    return out


def poison_pool(engine, seed: int = 0) -> None:
    """Fill every page of ``engine``'s KV pool with large junk (as a pool holds what earlier
    rollouts left there, only worse): a read of a position nobody wrote in this run moves the
    logits far beyond any tolerance. Masked positions may hold junk: their attention weight is
    exactly 0 (not NaN: 0 x NaN is NaN)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * len(engine._k)))

    def junk(x):
        return jax.device_put(30.0 * jax.random.normal(next(keys), x.shape, x.dtype), x.sharding)

    engine._k = tuple(junk(x) for x in engine._k)
    engine._v = tuple(junk(x) for x in engine._v)
