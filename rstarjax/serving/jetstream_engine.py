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
- **Failures.** JetStream's threads kill the process (SIGKILL) on any exception, so nothing
  raises out of ``prefill``, ``insert`` or ``generate``. ``prefill`` returns a ``Request`` (the
  opaque prefix JetStream carries to ``insert`` and keeps on its ``ActiveRequest``); a request
  that cannot run (empty, an id outside the vocabulary, no free pages, any engine error) or
  that fails while decoding is marked there (``Request.error``: a gRPC status name and a
  message) and ends (``valid=0``) while the others go on; the servicer
  (``ServingOrchestrator``) answers it with that status. A failed decode step fails the
  requests it was decoding, not the server. Over-long prompts are cut to their last
  ``max_prefill_length`` tokens by JetStream itself (``token_utils.pad_tokens``, with a
  warning).
- **Pages.** JetStream cannot pause a request (a live slot must emit a token every step), so
  there is no preemption: the pool must hold every slot at ``max_len`` and the prompts in
  flight outside the slots (``pool_pages``), and ``JetStreamEngine`` refuses a smaller one. A
  pool that still runs short (it cannot, short of a bug) fails the youngest request with
  ``RESOURCE_EXHAUSTED`` and steps the rest.
- **Length.** ``max_len`` bounds a request's prompt plus completion: ``prefill`` caps the
  request's budget at ``max_len - prompt`` (the engine alone would sample one token past a
  full slot).
- **Sampling.** JetStream 0.2.2 requests carry no sampling parameters: the server's
  ``SamplingParams`` apply to every request, request ``i`` seeded ``seed + i`` wrapped to a
  signed 32-bit integer (``request_seed``).
- **Servicer.** ``ServingOrchestrator`` (installed by ``patch_jetstream_for_current_jax``)
  is JetStream's ``LLMOrchestrator`` with: text built incrementally from the streamed ids
  (``completions.TextStream``: a character split across tokens is held back until complete,
  where JetStream's per-token decode turned it into U+FFFD), a request without content
  answered ``INVALID_ARGUMENT``, a failed request answered with its status, the reason a
  stream ended in the trailing metadata ``finish-reason`` (``stop``, ``max_tokens``,
  ``length``: ``--max_new_tokens``, ``context``: ``max_len``), and a drain for shutdown
  (``stop_server``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Sequence

import jax
import numpy as np
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from rstarjax.models.kv_cache import pages_for
from rstarjax.models.tokenizer import Tokenizer
from rstarjax.models.sharding import device_mesh
from rstarjax.serving.completions import TextStream
from rstarjax.serving.jetstream_contract import JetStreamContractEngine, Prefix
from rstarjax.serving.pages import OutOfPages
from rstarjax.serving.programs import MAX_STOP_IDS, DoneReason
from rstarjax.serving.sampling import SamplingParams

NO_BOS = -1  # our models have no BOS token: JetStream's prepended one is dropped in prefill
# Prompt buckets of ``token_utils.pad_tokens``: ``max_prefill_length`` must be one of them.
JETSTREAM_PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Prefixes that can hold pages outside the slots in interleaved mode: one being prefilled, one
# in the transfer queue, one held by the transfer thread, one in the generate queue, one the
# generate thread took from that queue and has not inserted yet.
PREFIXES_IN_FLIGHT = 5

log = logging.getLogger(__name__)


def request_seed(seed: int, i: int) -> int:
    """Request ``i``'s seed: ``seed + i`` wrapped to a signed 32-bit integer (two's complement,
    what the engine keys its random stream with), so no request number overflows it."""
    return (int(seed) + int(i) + 2**31) % 2**32 - 2**31


def pool_pages(num_slots: int, max_len: int, page_size: int, max_prefill_length: int) -> int:
    """KV pages JetStream can hold at once: every slot at ``max_len`` (a slot JetStream
    completed keeps decoding until it is reused) and ``PREFIXES_IN_FLIGHT`` prompts of at most
    ``max_prefill_length`` tokens outside the slots."""
    return (num_slots * pages_for(max_len, page_size)
            + PREFIXES_IN_FLIGHT * pages_for(max_prefill_length, page_size))


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
        """Text of ``token_ids`` alone (JetStream's detokenize thread calls it per token; our
        servicer ignores it and streams ``completions.TextStream``'s text of the ids instead,
        as a token alone can be part of a character). A lone byte that is not valid UTF-8 is
        written ``<0xAB>``, JetStream's byte-token notation; longer partial characters become
        U+FFFD."""
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


_FINISH = {DoneReason.STOP: "stop", DoneReason.BUDGET: "length", DoneReason.CONTEXT: "context"}


@dataclasses.dataclass(eq=False)
class Request:
    """One request, as ``prefill`` returns it to JetStream (its opaque prefix, carried to
    ``insert`` and kept as ``ActiveRequest.prefill_result``): the engine's ``Prefix``, and how
    the request ended. ``error``: (gRPC status name, message) when it failed (no prefix then,
    or the prefix's pages were returned); ``finish``: why the engine ended it (``stop``,
    ``length``: the server's ``max_new_tokens``, ``context``: ``max_len``)."""

    prefix: Prefix | None = None
    error: tuple[str, str] | None = None
    finish: str | None = None
    context_capped: bool = False  # its budget is max_len - prompt, below max_new_tokens

    def fail(self, code: str, why: str) -> None:
        if self.error is None and self.finish is None:
            self.error = (code, why)

    def done(self, reason: DoneReason) -> None:
        if self.error is None and self.finish is None:
            finish = _FINISH[DoneReason(int(reason))]
            self.finish = "context" if finish == "length" and self.context_capped else finish


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
    ``max_new_tokens`` caps every request besides JetStream's ``max_tokens``, and
    ``engine.max_len`` caps prompt + completion); its ``stop_ids`` (at most
    ``MAX_STOP_IDS``, in the vocabulary) default to the tokenizer's ``<|im_end|>`` and
    ``<|endoftext|>``, and are the ids both the engine stops on and JetStream's detokenizer
    ends requests on (a stop id is not returned to the client). ``max_prefill_length`` must be
    a JetStream prompt bucket below ``engine.max_len`` (default: the largest). The engine's
    pool must hold ``pool_pages`` pages (module docstring, "Pages")."""

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
        if len(sampling.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(sampling.stop_ids)}")
        outside = [t for t in sampling.stop_ids if not 0 <= t < tokenizer.num_tokens]
        if outside:
            raise ValueError(f"stop id {outside[0]} is outside the vocabulary "
                             f"[0, {tokenizer.num_tokens})")
        self.sampling = sampling
        n = max_prefill_length or default_max_prefill_length(engine.max_len)
        if n not in JETSTREAM_PREFILL_LENGTHS or n >= engine.max_len:
            raise ValueError(f"max_prefill_length {n} must be one of {JETSTREAM_PREFILL_LENGTHS} "
                             f"and below max_len {engine.max_len}")
        need = pool_pages(engine.num_slots, engine.max_len, engine.page_size, n)
        if engine.num_pages < need:
            raise ValueError(
                f"a KV pool of {engine.num_pages} pages cannot hold {engine.num_slots} slots at "
                f"max_len {engine.max_len} and {PREFIXES_IN_FLIGHT} prompts in flight: JetStream "
                f"cannot pause a request to wait for pages, so it needs {need}")
        self._max_prefill_length = n
        self._device = engine.device or jax.local_devices()[0]
        self._lock = threading.Lock()
        self._requests = 0  # prefills so far: request i samples with request_seed(seed, i)
        self._inserted = 0  # inserts so far: the youngest request is the first to fail
        self._reset()

    def _reset(self) -> None:
        b = self.engine.num_slots
        self._parked: dict[int, Request] = {}  # inserted, first token not yet emitted
        self._live: dict[int, Request] = {}  # the request each engine slot decodes
        self._age = np.zeros(b, np.int64)  # insert number of each slot's request
        self._sampled = np.zeros(b, np.int32)  # tokens the slot's request sampled so far

    # ---- engine_api.Engine -----------------------------------------------------------------
    def load_params(self, *args, **kwargs):
        """The engine's serving copy of the weights (made when the engine was built)."""
        return self.engine.params

    def init_decode_state(self, *args, **kwargs):
        with self._lock:
            for slot in self.engine.live_slots():
                self._free_quietly(slot)
            self._reset()
            # the pool as it is: a prompt prefilled before the generate thread asked for its
            # state (a request at the server's first moment) keeps its pages
            return self.engine.blank_decode_state()

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int) -> Request:
        """The request's prompt into pages and its first token sampled: a ``Request`` (with
        its error when it cannot run; never raises, see the module docstring)."""
        if isinstance(existing_prefix, Request):
            if existing_prefix.error is not None:
                return existing_prefix
            existing_prefix = existing_prefix.prefix
        try:
            tokens = np.asarray(padded_tokens).reshape(-1)[: int(true_length)].astype(np.int64)
            if existing_prefix is None and tokens.size and tokens[0] == NO_BOS:
                tokens = tokens[1:]
            vocab = self.tokenizer.num_tokens
            if tokens.size == 0:
                return self._failed("INVALID_ARGUMENT", "empty prompt")
            if tokens.min() < 0 or tokens.max() >= vocab:
                return self._failed("INVALID_ARGUMENT", f"token ids outside [0, {vocab})")
            with self._lock:
                i = self._requests
                self._requests += 1
                if existing_prefix is None:
                    room = self.engine.max_len - int(tokens.size)  # prompt + completion <= max_len
                    budget = min(self.sampling.max_new_tokens, max(room, 1))
                    sampling = dataclasses.replace(self.sampling, seed=request_seed(self.sampling.seed, i),
                                                   max_new_tokens=budget)
                else:
                    room, sampling = self.sampling.max_new_tokens, None  # the prefix's own
                prefix = self.engine.prefill(params, tokens.astype(np.int32),
                                             existing_prefix=existing_prefix, sampling=sampling)
            return Request(prefix, context_capped=room < self.sampling.max_new_tokens)
        except OutOfPages as e:
            return self._failed("RESOURCE_EXHAUSTED", f"the KV pool has no pages for the prompt: {e}")
        except ValueError as e:
            return self._failed("INVALID_ARGUMENT", str(e))
        except Exception as e:  # noqa: BLE001 - an exception here would kill the server
            log.exception("JetStream prefill failed")
            return self._failed("INTERNAL", f"prefill failed: {type(e).__name__}: {e}")

    def insert(self, prefix, decode_state, slot: int):
        """Park ``prefix`` for ``slot``; the next ``generate`` inserts it into the engine after
        its decode step and emits its first token (module docstring)."""
        request = prefix if isinstance(prefix, Request) else Request(prefix)
        with self._lock:
            try:
                self.engine.free_resource(slot)  # the request JetStream completed there, if any
            except Exception:  # noqa: BLE001 - an exception here would kill the server
                log.exception("JetStream insert: freeing slot %d failed", slot)
            self._live.pop(slot, None)
            self._parked[slot] = request
            self._sampled[slot] = 0
        return decode_state

    def generate(self, params, decode_state):
        """One decode step of every decoding slot, then the parked prefixes inserted (their
        first tokens emitted). Never raises: a failed step fails the requests it decoded."""
        b = self.engine.num_slots
        tokens, valid = np.zeros(b, np.int32), np.zeros(b, np.int32)
        with self._lock:
            decode_state = self._step(params, decode_state, tokens, valid)
            for slot, request in self._parked.items():
                if request.error is not None:
                    continue  # valid stays 0: JetStream ends the request, the servicer fails it
                try:
                    decode_state = self.engine.insert(request.prefix, decode_state, slot)
                except Exception as e:  # noqa: BLE001 - an exception here would kill the server
                    log.exception("JetStream insert into slot %d failed", slot)
                    self._drop(slot, request.prefix)
                    request.fail("INTERNAL", f"insert failed: {type(e).__name__}: {e}")
                    continue
                tokens[slot], valid[slot] = request.prefix.token, 1
                self._inserted += 1
                self._age[slot] = self._inserted
                if request.prefix.done != DoneReason.NOT_DONE:
                    request.done(request.prefix.done)
                    self._free_quietly(slot)
                else:
                    self._live[slot] = request
            self._parked = {}
            self._sampled += valid
            lengths = self._sampled.copy()
        data = np.stack([tokens, valid, lengths], axis=1)
        return decode_state, engine_api.ResultTokens(
            data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
            samples_per_slot=1)

    def free_resource(self, slot: int) -> None:
        with self._lock:
            request = self._parked.pop(slot, None)
            if request is not None and request.prefix is not None:
                self._drop(slot, request.prefix)
            self._live.pop(slot, None)
            self._free_quietly(slot)

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
    def _failed(self, code: str, why: str) -> Request:
        log.error("JetStream request rejected (%s): %s", code, why)
        return Request(error=(code, why))

    def _step(self, params, decode_state, tokens: np.ndarray, valid: np.ndarray):
        """The decode step of ``generate`` (holding the lock): fills ``tokens`` / ``valid``.
        Out of pages: the youngest request fails and the step is retried without it; any other
        error fails every request the step decoded (the decode state is rebuilt)."""
        b = self.engine.num_slots
        while True:
            decoding = [s for s in range(b) if self.engine.is_decoding(s)]
            if not decoding:
                return decode_state
            try:
                decode_state, step = self.engine.generate(params, decode_state)
            except OutOfPages as e:
                victim = max(decoding, key=lambda s: self._age[s])
                log.error("JetStream: KV pool out of pages, failing the request in slot %d: %s",
                          victim, e)
                self._fail_slot(victim, "RESOURCE_EXHAUSTED",
                                f"the KV pool ran out of pages while this request decoded ({e}); "
                                f"retry it")
                continue
            except Exception as e:  # noqa: BLE001 - an exception here would kill the server
                log.exception("JetStream decode step failed")
                for s in self.engine.live_slots():
                    self._fail_slot(s, "INTERNAL", f"decode step failed: {type(e).__name__}: {e}")
                try:  # the device state anew; the pool keeps the pages of prompts still in flight
                    decode_state = self.engine.blank_decode_state()
                except Exception:  # noqa: BLE001
                    log.exception("JetStream: rebuilding the decode state failed")
                return decode_state
            tokens[:] = step.tokens
            valid[:] = step.valid
            for s in np.flatnonzero(step.done != DoneReason.NOT_DONE):
                request = self._live.pop(int(s), None)
                if request is not None:
                    request.done(step.done[s])
                self._free_quietly(int(s))  # ends the request at the next step
            return decode_state

    def _fail_slot(self, slot: int, code: str, why: str) -> None:
        request = self._live.pop(slot, None)
        if request is not None:
            request.fail(code, why)
        self._free_quietly(slot)

    def _free_quietly(self, slot: int) -> None:
        """Free ``slot``'s pages; a failure is logged, never raised (JetStream's thread would
        kill the server)."""
        try:
            self.engine.free_resource(slot)
        except Exception:  # noqa: BLE001
            log.exception("JetStream: freeing slot %d failed", slot)

    def _drop(self, slot: int, prefix: Prefix) -> None:
        """Return the pages of ``prefix``, parked for ``slot`` and never decoded."""
        try:
            if prefix.inserted:
                self.engine.free_resource(slot)
            else:
                self.engine.release(prefix)
        except Exception:  # noqa: BLE001
            log.exception("JetStream: returning the pages of slot %d's prompt failed", slot)


def patch_jetstream_for_current_jax() -> None:
    """What google-jetstream 0.2.2 needs to serve here, applied to its modules (idempotent):
    its orchestrator calls ``jax.tree_map``, removed from JAX since, so its ``delete_pytree``
    points at ``jax.tree.map`` (same behaviour); and ``server_lib.run`` builds our servicer,
    ``ServingOrchestrator``, in place of its ``LLMOrchestrator`` (module docstring)."""
    from jetstream.core import orchestrator

    orchestrator.LLMOrchestrator = serving_orchestrator_class()
    if hasattr(jax, "tree_map"):
        return

    def delete_pytree(p):
        def delete_leaf(leaf):
            if isinstance(leaf, jax.Array):
                leaf.delete()

        jax.tree.map(delete_leaf, p)

    orchestrator.delete_pytree = delete_pytree


class ShutDown(Exception):
    """Ends the stream of a request still running when the server stops (``stop_server``)."""


NO_SESSION_CACHE = ("session_cache is not supported: this server keeps no state between requests "
                    "(send the whole conversation as the prompt)")
NO_CONTENT = ("the DecodeRequest has no content: set token_content.token_ids (ids in, ids out) "
              "or text_content.text")
SHUTTING_DOWN = "the server is shutting down: retry on another replica or after it restarts"


@functools.lru_cache(maxsize=None)
def serving_orchestrator_class():
    """``ServingOrchestrator``: JetStream's gRPC servicer (``LLMOrchestrator``) with what this
    module's docstring lists ("Servicer"). Made on first use: importing JetStream's
    orchestrator sets the root logger to DEBUG."""
    import grpc
    from jetstream.core import orchestrator
    from jetstream.core.proto import jetstream_pb2
    from jetstream.core.utils import async_multifuture

    base = orchestrator.LLMOrchestrator
    while getattr(base, "rstarjax_servicer", False):  # patched already: JetStream's own class
        base = base.__bases__[0]
    Sample = jetstream_pb2.DecodeResponse.StreamContent.Sample

    async def abort(context, code, details: str):
        if context is None:
            raise RuntimeError(details)
        await context.abort(code, details)

    class ServingOrchestrator(base):
        rstarjax_servicer = True

        def __init__(self, driver):
            super().__init__(driver=driver)
            driver.rstarjax_servicer = self  # stop_server finds it there
            engine = driver._generate_engines[0]
            self._tokenizer = engine.build_tokenizer(engine.get_tokenizer()).tokenizer
            self._lock = threading.Lock()
            self._in_flight: dict[int, object] = {}  # id(ActiveRequest) -> its return channel
            self.draining = False

        def in_flight(self) -> int:
            with self._lock:
                return len(self._in_flight)

        def cancel_in_flight(self, why: str) -> int:
            """End every running stream with ``UNAVAILABLE: why``; how many there were."""
            with self._lock:
                channels = list(self._in_flight.values())
            for channel in channels:
                channel.set_exception(ShutDown(why))
            return len(channels)

        async def HealthCheck(self, request, context=None):  # noqa: N802 - gRPC's name
            return jetstream_pb2.HealthCheckResponse(is_live=self._driver.live and not self.draining)

        async def Decode(self, request, context=None):  # noqa: N802 - gRPC's name
            if request.WhichOneof("content") is None:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, NO_CONTENT)
            if request.session_cache:  # JetStream's prefill thread pads it as an array and dies
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, NO_SESSION_CACHE)
            if self.draining:
                await abort(context, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            channel = async_multifuture.AsyncMultifuture()
            if context is not None:
                context.add_done_callback(channel.cancel)
            content, client_side = self._get_prefill_content(request)
            active = orchestrator.ActiveRequest(
                max_tokens=request.max_tokens, history_path=request.session_cache,
                prefill_content=content, is_client_side_tokenization=client_side,
                return_channel=channel)
            with self._lock:
                self._in_flight[id(active)] = channel
            texts: list[TextStream] = []  # one per sample
            sent = 0  # ids of sample 0 streamed
            try:
                try:
                    self._driver.place_request_on_prefill_queue(active)
                except queue.Full:
                    await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "the prefill queue is full: retry this request")
                try:
                    async for samples in channel:
                        sent += len(samples[0].token_ids) if samples else 0
                        if client_side:
                            yield self.process_client_side_tokenization_response(samples)
                            continue
                        while len(texts) < len(samples):
                            texts.append(TextStream(self._tokenizer))
                        yield jetstream_pb2.DecodeResponse(
                            stream_content=jetstream_pb2.DecodeResponse.StreamContent(samples=[
                                Sample(text=t.add(x.token_ids), token_ids=x.token_ids)
                                for t, x in zip(texts, samples)]))
                except ShutDown as e:
                    await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
                tails = [t.finish() for t in texts]
                if any(tails):  # bytes that never formed a character: U+FFFD, as decode() has
                    yield jetstream_pb2.DecodeResponse(
                        stream_content=jetstream_pb2.DecodeResponse.StreamContent(
                            samples=[Sample(text=tail) for tail in tails]))
                outcome = active.prefill_result
                if not isinstance(outcome, Request):
                    return
                if outcome.error is not None and sent < active.max_tokens:
                    code, why = outcome.error
                    await abort(context, getattr(grpc.StatusCode, code), why)
                reason = "max_tokens" if sent >= active.max_tokens else outcome.finish
                if reason and context is not None:
                    context.set_trailing_metadata((("finish-reason", reason),))
            finally:
                with self._lock:
                    self._in_flight.pop(id(active), None)

    return ServingOrchestrator


def stop_server(server, grace_s: float, hurry: threading.Event | None = None) -> dict:
    """Stop a ``server_lib.JetStreamServer`` running ``ServingOrchestrator``: refuse new
    requests (``UNAVAILABLE``; health checks answer not live), give the running ones up to
    ``grace_s`` seconds (less once ``hurry`` is set) to finish, end those left with
    ``UNAVAILABLE``, then stop the gRPC server and JetStream's threads. Returns what happened:
    ``{"in_flight", "finished", "cancelled", "seconds", "threads_stopped"}``."""
    t0 = time.monotonic()
    servicer = getattr(server._driver, "rstarjax_servicer", None)
    in_flight = cancelled = 0
    if servicer is not None:
        servicer.draining = True
        in_flight = servicer.in_flight()
        while (servicer.in_flight() and time.monotonic() - t0 < grace_s
               and not (hurry is not None and hurry.is_set())):
            time.sleep(0.05)
        cancelled = servicer.cancel_in_flight(
            f"the server shut down before this request finished (--shutdown_grace {grace_s:g} s)")
        deadline = time.monotonic() + 5.0
        while servicer.in_flight() and time.monotonic() < deadline:  # the aborts go out
            time.sleep(0.02)
    try:  # gRPC first, so that no call is left waiting on JetStream's threads
        asyncio.run_coroutine_threadsafe(server._grpc_server.stop(grace=1.0),
                                         server._loop).result(timeout=15)
    except Exception:  # noqa: BLE001 - still stop the threads
        log.exception("stopping the gRPC server failed")
    stopper = threading.Thread(target=server._driver.stop, name="stop-driver", daemon=True)
    stopper.start()
    stopper.join(timeout=15)
    server._loop.call_soon_threadsafe(server._loop.stop)
    server._loop_thread.join(timeout=5)
    server._executor.shutdown(wait=False)
    return {"in_flight": in_flight, "finished": in_flight - cancelled, "cancelled": cancelled,
            "seconds": round(time.monotonic() - t0, 1),
            "threads_stopped": not stopper.is_alive() and not server._loop_thread.is_alive()}
