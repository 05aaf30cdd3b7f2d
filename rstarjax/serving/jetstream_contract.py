"""JetStream's engine contract (``prefill / insert / generate / release``) on the paged slot
engine: what ``serving.jetstream_engine.JetStreamEngine`` translates JetStream's calls into. The
rollout scheduler never uses it (it drives the native ``Engine.start / decode / extend_many``).

``prefill`` runs a prompt into pages of the pool that belong to a ``Prefix`` (not yet to a
slot) and samples its first token; ``insert`` hands a prefix's pages to a free slot, which
decodes from its first token on; ``generate`` is one decode step of every active slot
(``Engine.decode`` with one step); ``release`` returns the pages of a prefix that is never
inserted. Every token is computed by the native engine's feed and decode programs.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rstarjax.models.kv_cache import pages_for
from rstarjax.serving.engine import Engine, forced_ids
from rstarjax.serving.programs import FeedRow, FeedSample
from rstarjax.serving.programs import DecodeState, DoneReason, stop_row
from rstarjax.serving.sampling import SamplingParams


@dataclasses.dataclass
class Prefix:
    """Result of ``prefill``: pages of the pool holding the prompt, and its first token. The
    pages belong to the prefix until ``insert`` hands them to a slot (``release`` returns the
    pages of a prefix that is never inserted)."""

    pages: list[int]
    length: int  # tokens in the pages (prompt length)
    token: int
    logprob: float
    sampling: SamplingParams
    done: DoneReason  # the first token may already end the request
    counter: int = 1  # tokens sampled by the request so far
    inserted: bool = False


@dataclasses.dataclass
class ResultTokens:
    """Host copy of one ``generate`` step: per slot."""

    tokens: np.ndarray  # int32[B]
    logprobs: np.ndarray  # f32[B]
    valid: np.ndarray  # bool[B]: the slot was decoding this step (token is real)
    done: np.ndarray  # int32[B] DoneReason, nonzero the step a slot stops
    lengths: np.ndarray  # int32[B] tokens in the cache after the step


class JetStreamContractEngine(Engine):
    """``Engine`` plus JetStream's contract (module docstring); built like ``Engine``."""

    @property
    def max_concurrent_decodes(self) -> int:
        return self.num_slots

    @property
    def max_prefill_length(self) -> int:
        return self.max_len

    def prefill(self, params, tokens: Sequence[int], true_length: int | None = None,
                existing_prefix: Prefix | None = None, *, sampling: SamplingParams | None = None,
                forced_token: int = -1) -> Prefix:
        """Run a prompt (or append it to ``existing_prefix``) into free pages of the pool and
        sample its first token. Raises ``OutOfPages`` when the pool cannot hold it."""
        sampling = sampling or (existing_prefix.sampling if existing_prefix else SamplingParams())
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = int(true_length if true_length is not None else tokens.shape[0])
        if n < 1 or n > tokens.shape[0]:
            raise ValueError(f"true_length {n} must be in [1, {tokens.shape[0]}]")
        tokens = tokens[:n]
        self._check_ids(tokens, "prefill")
        self._check_ids(forced_ids(forced_token), "prefill's forced token")
        if existing_prefix is not None:
            if existing_prefix.inserted:
                raise ValueError("the prefix was inserted into a slot already")
            tokens = np.concatenate([[existing_prefix.token], tokens]).astype(np.int32)
            held, start, counter = list(existing_prefix.pages), existing_prefix.length, \
                existing_prefix.counter
        else:
            held, start, counter = [], 0, 0
        length = start + len(tokens)
        if length > self.max_len:
            raise ValueError(f"prompt of {length} tokens does not fit max_len {self.max_len}")
        added = self.pages.alloc(pages_for(length, self.page_size) - len(held))
        pages = held + added
        sample = FeedSample(-1, sampling, counter, sampling.max_new_tokens - counter,
                            forced_token, length)
        try:
            [(tok, lp, done)], _ = self._run_rows(params, None,
                                                  [FeedRow(pages, start, tokens, [sample])])
        except BaseException:
            self.pages.release(added)  # the prefix keeps its own pages (the feed wrote past them)
            raise
        if existing_prefix is not None:
            existing_prefix.pages = []  # handed to the new prefix only once it exists
        return Prefix(pages=pages, length=length, token=tok, logprob=lp, sampling=sampling,
                      done=done, counter=counter + 1)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Place a prefix in ``slot`` (its pages become the slot's); the slot decodes from its
        first token on."""
        self.slots.check(slot)
        if self.slots[slot] is not None:
            raise ValueError(f"slot {slot} holds a request: free_resource it first")
        if prefix.inserted:
            raise ValueError("a Prefix can be inserted once (prefill again for another slot)")
        s = prefix.sampling
        stop_row(s)  # refuses too many stop ids before the slot is taken
        prefix.inserted = True
        budget = s.max_new_tokens - prefix.counter
        self.slots.bind(slot, prefix.pages, prefix.length, prefix.token, prefix.counter, budget,
                        s, prefix.done == DoneReason.NOT_DONE)
        return self._insert(decode_state, [slot], [], [])

    def generate(self, params, decode_state: DecodeState,
                 forced: np.ndarray | None = None) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every active slot. ``forced[b] >= 0`` teacher-forces slot b.
        Raises ``OutOfPages`` when an active slot needs a page the pool does not have (the
        scheduler preempts instead)."""
        f = None if forced is None else np.asarray(forced, np.int32)[None]
        state, block = self.decode(params, decode_state, steps=1, forced=f)
        return state, ResultTokens(block.tokens[0], block.logprobs[0], block.valid[0],
                                   block.done[0], block.lengths)

    def release(self, prefix: Prefix) -> None:
        """Return the pages of a prefix that will not be inserted."""
        if not prefix.inserted:
            self.pages.release(prefix.pages)
            prefix.pages, prefix.inserted = [], True
