"""JetStream's ``engine_api.Engine`` over the paged slot engine (needs the ``[jetstream]`` extra).

``JetStreamEngine`` translates; every token is computed by the paged slot engine rollouts use,
through its JetStream contract (``serving.jetstream_contract.JetStreamContractEngine``):
``prefill`` is its ``prefill`` (paged prompt, first token sampled), ``insert`` its ``insert``,
``generate`` its ``generate`` (one decode step of every active slot), with the same sampling. What the translation has to bridge (google-jetstream
0.2.2, whose orchestrator runs a prefill thread, a generate thread and a detokenize thread):

- **First token.** JetStream 0.2.2's ``prefill`` returns only the prefix and its orchestrator
  emits only what ``generate`` returns, while our prefill samples the request's first token.
  So ``insert`` parks the prefix and the next ``generate`` inserts it into the engine *after*
  the decode step, emitting the prefill's token for that slot; the slot decodes from the
  following step on. Every live slot emits one valid token per step, as JetStream requires
  (an invalid token ends the request).
- **ResultTokens.** One row per slot, columns ``[token, valid, length]``; ``length`` counts the
  tokens the request has sampled, this one included, so JetStream's ``length > max_tokens``
  check returns exactly ``max_tokens`` tokens. A slot the engine stopped (a stop id, the
  ``max_new_tokens`` budget, a full slot) reports ``valid=0`` from the next step, which ends
  the request; its slot and pages are freed at once.
- **Slots.** JetStream never calls ``free_resource``: a slot it completes (``max_tokens``) is
  freed when the next prefix is inserted into it (it may decode a few wasted steps until then,
  as in JetStream's own design).
- **Threads.** The prefill and generate threads share one KV page pool (interleaved mode
  only: prefill and generate on the same devices), so every engine call holds one lock.
- **BOS.** Qwen has no BOS token, but JetStream prepends ``tokenizer.bos_id`` to token-id
  requests; ``bos_id`` is ``NO_BOS`` (-1) and ``prefill`` drops it.
- **Bad requests.** JetStream's threads kill the server on any exception, so a request that
  cannot run (empty, an id outside the vocabulary, no free pages) is logged and answered
  with no tokens instead. Over-long prompts are cut to their last ``max_prefill_length``
  tokens by JetStream itself (``token_utils.pad_tokens``, with a warning).
- **Sampling.** JetStream 0.2.2 requests carry no sampling parameters: the server's
  ``SamplingParams`` apply to every request, request ``i`` seeded ``seed + i``.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Sequence

import jax
import numpy as np
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from rstarjax.models.tokenizer import Tokenizer
from rstarjax.models.sharding import device_mesh
from rstarjax.serving.jetstream_contract import JetStreamContractEngine, Prefix
from rstarjax.serving.pages import OutOfPages
from rstarjax.serving.programs import DoneReason
from rstarjax.serving.sampling import SamplingParams

NO_BOS = -1  # our models have no BOS token: JetStream's prepended one is dropped in prefill
# Prompt buckets of ``token_utils.pad_tokens``: ``max_prefill_length`` must be one of them.
JETSTREAM_PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Prefixes that can hold pages outside the slots in interleaved mode: one being prefilled, one
# in the transfer queue, one held by the transfer thread, one in the generate queue.
PREFIXES_IN_FLIGHT = 4

log = logging.getLogger(__name__)


class JetStreamTokenizer(tokenizer_api.Tokenizer):
    """Our Qwen tokenizer under JetStream's tokenizer API (server-side text requests)."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self._stop_ids = frozenset(int(t) for t in stop_ids)

    def encode(self, s: str, **kwargs):
        """Ids of ``s`` (added tokens such as ``<|im_start|>`` written in it become their ids),
        padded to a JetStream bucket; no BOS (``is_bos`` is ignored)."""
        return token_utils.pad_tokens(
            np.asarray(self.tokenizer.encode(s), np.int32), NO_BOS, self.pad_id, is_bos=False,
            prefill_lengths=kwargs.get("prefill_lengths"),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True))

    def decode(self, token_ids, **kwargs) -> str:
        """Text of ``token_ids``. JetStream streams one token at a time: a lone byte that is not
        valid UTF-8 is written ``<0xAB>``, which the orchestrator buffers and joins with the
        bytes that follow; longer partial characters become U+FFFD."""
        data = self.tokenizer.decode_bytes(token_ids)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            if len(data) == 1:
                return f"<0x{data[0]:02X}>"
            return data.decode("utf-8", errors="replace")

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int:
        return NO_BOS

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._stop_ids)


@dataclasses.dataclass
class Rejected:
    """The ``prefill`` result of a request that cannot run: answered with no tokens."""

    why: str


def default_max_prefill_length(max_len: int) -> int:
    """The largest JetStream prompt bucket that leaves room for one generated token."""
    fits = [n for n in JETSTREAM_PREFILL_LENGTHS if n < max_len]
    if not fits:
        raise ValueError(f"max_len {max_len} leaves no JetStream prompt bucket "
                         f"(the smallest is {JETSTREAM_PREFILL_LENGTHS[0]} tokens)")
    return fits[-1]


class JetStreamEngine(engine_api.Engine):
    """``engine_api.Engine`` over ``engine`` (see the module docstring).

    ``sampling`` applies to every request (its ``seed`` is the first request's; its
    ``max_new_tokens`` caps every request besides JetStream's ``max_tokens``); its
    ``stop_ids`` default to the tokenizer's ``<|im_end|>`` and ``<|endoftext|>``, and are the
    ids both the engine stops on and JetStream's detokenizer ends requests on (a stop id is
    not returned to the client). ``max_prefill_length`` must be a JetStream prompt bucket
    below ``engine.max_len`` (default: the largest)."""

    def __init__(self, engine: JetStreamContractEngine, tokenizer: Tokenizer,
                 sampling: SamplingParams | None = None, max_prefill_length: int | None = None,
                 tokenizer_path: str = ""):
        if not isinstance(engine, JetStreamContractEngine):
            raise TypeError(f"JetStreamEngine needs a serving.jetstream_contract."
                            f"JetStreamContractEngine (prefill / insert / generate), got "
                            f"{type(engine).__name__}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        sampling = sampling or SamplingParams(temperature=0.0, max_new_tokens=engine.max_len)
        if not sampling.stop_ids:
            sampling = dataclasses.replace(sampling, stop_ids=(tokenizer.eos_id, tokenizer.pad_id))
        self.sampling = sampling
        n = max_prefill_length or default_max_prefill_length(engine.max_len)
        if n not in JETSTREAM_PREFILL_LENGTHS or n >= engine.max_len:
            raise ValueError(f"max_prefill_length {n} must be one of {JETSTREAM_PREFILL_LENGTHS} "
                             f"and below max_len {engine.max_len}")
        self._max_prefill_length = n
        self._device = engine.device or jax.local_devices()[0]
        self._lock = threading.Lock()
        self._requests = 0  # prefills so far: request i samples with seed + i
        self._reset()

    def _reset(self) -> None:
        b = self.engine.num_slots
        self._parked: dict[int, Prefix | Rejected] = {}  # inserted, first token not yet emitted
        self._sampled = np.zeros(b, np.int32)  # tokens the slot's request sampled so far

    # ---- engine_api.Engine -----------------------------------------------------------------
    def load_params(self, *args, **kwargs):
        """The engine's serving copy of the weights (made when the engine was built)."""
        return self.engine.params

    def init_decode_state(self, *args, **kwargs):
        with self._lock:
            self._reset()
            return self.engine.init_decode_state()

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int):
        tokens = np.asarray(padded_tokens).reshape(-1)[: int(true_length)].astype(np.int64)
        if existing_prefix is None and tokens.size and tokens[0] == NO_BOS:
            tokens = tokens[1:]
        vocab = self.tokenizer.num_tokens
        if tokens.size == 0:
            return self._reject("empty prompt")
        if tokens.min() < 0 or tokens.max() >= vocab:
            return self._reject(f"token ids outside [0, {vocab})")
        with self._lock:
            sampling = dataclasses.replace(self.sampling, seed=self.sampling.seed + self._requests)
            self._requests += 1
            try:
                return self.engine.prefill(params, tokens.astype(np.int32),
                                           existing_prefix=existing_prefix, sampling=sampling)
            except (OutOfPages, ValueError) as e:
                return self._reject(str(e))

    def insert(self, prefix, decode_state, slot: int):
        """Park ``prefix`` for ``slot``; the next ``generate`` inserts it into the engine after
        its decode step and emits its first token (module docstring)."""
        with self._lock:
            self.engine.free_resource(slot)  # the request JetStream completed there, if any
            self._parked[slot] = prefix
            self._sampled[slot] = 0
        return decode_state

    def generate(self, params, decode_state):
        b = self.engine.num_slots
        tokens, valid = np.zeros(b, np.int32), np.zeros(b, np.int32)
        with self._lock:
            if any(self.engine.is_decoding(s) for s in range(b)):
                decode_state, step = self.engine.generate(params, decode_state)
                tokens[:] = step.tokens
                valid[:] = step.valid
                for s in np.flatnonzero(step.done != DoneReason.NOT_DONE):
                    self.engine.free_resource(int(s))  # ends the request at the next step
            for slot, prefix in self._parked.items():
                if isinstance(prefix, Rejected):
                    continue  # valid stays 0: JetStream ends the request with no tokens
                decode_state = self.engine.insert(prefix, decode_state, slot)
                tokens[slot], valid[slot] = prefix.token, 1
                if prefix.done != DoneReason.NOT_DONE:
                    self.engine.free_resource(slot)
            self._parked = {}
            self._sampled += valid
            lengths = self._sampled.copy()
        data = np.stack([tokens, valid, lengths], axis=1)
        return decode_state, engine_api.ResultTokens(
            data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
            samples_per_slot=1)

    def free_resource(self, slot: int) -> None:
        with self._lock:
            self._parked.pop(slot, None)
            self.engine.free_resource(slot)

    def get_prefix_destination_sharding(self):
        """Prefixes live in the engine's page pool: there is nothing to transfer (interleaved
        mode only; JetStream calls this in disaggregated mode alone)."""
        return None

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(
            path=self.tokenizer_path or f"qwen3-bpe-{self.tokenizer.num_regular_tokens}")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
        return JetStreamTokenizer(self.tokenizer, self.sampling.stop_ids)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return device_mesh([self._device], ("data",))

    @property
    def colocated_cpus(self):
        return None

    # ---- internals -------------------------------------------------------------------------
    def _reject(self, why: str) -> Rejected:
        log.error("JetStream request rejected: %s", why)
        return Rejected(why)


def patch_jetstream_for_current_jax() -> None:
    """google-jetstream 0.2.2's orchestrator calls ``jax.tree_map``, removed from JAX since;
    point its ``delete_pytree`` at ``jax.tree.map`` (same behaviour)."""
    from jetstream.core import orchestrator

    if hasattr(jax, "tree_map"):
        return

    def delete_pytree(p):
        def delete_leaf(leaf):
            if isinstance(leaf, jax.Array):
                leaf.delete()

        jax.tree.map(delete_leaf, p)

    orchestrator.delete_pytree = delete_pytree
