"""Batch completion of prompts: ``generate`` (a whole scheduled run, not one decode step) drives
the rollout scheduler's loop, each prompt a one-turn episode, so slot refills, shared prompts,
page admission and preemption are the same code as for agent rollouts. ``TextStream`` turns
a stream of sampled ids into text pieces (the JetStream server's text responses)."""
from __future__ import annotations

import codecs
import dataclasses
from typing import Sequence

from rstarjax.serving.engine import Engine
from rstarjax.serving.programs import DoneReason
from rstarjax.serving.sampling import SamplingParams
from rstarjax.serving.scheduler import Finish, RolloutScheduler


@dataclasses.dataclass
class Completion:
    token_ids: list[int]  # sampled ids, stop id included when it stopped on one
    logprobs: list[float]  # policy log-prob of each sampled id
    finish: str  # "stop" | "length" | "context"
    prompt_len: int = 0


_FINISH = {DoneReason.STOP: "stop", DoneReason.BUDGET: "length", DoneReason.CONTEXT: "context"}


@dataclasses.dataclass
class _OneTurn:
    """A prompt as a one-turn episode (``scheduler.Episode``)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    out: Completion | None = None

    def forced_token(self, turn_offset: int) -> int:
        return -1

    def on_turn_end(self, ids, logprobs, reason: DoneReason):
        self.out = Completion(list(ids), list(logprobs), _FINISH[reason], len(self.prompt_ids))
        return Finish()

    def on_tool_ready(self, ids, free_tokens_in_slot):  # never called: no tool calls
        return Finish()

    def on_abort(self, why: str) -> None:
        raise RuntimeError(why)


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: Sequence[int] | None = None,
    num_slots: int = 8,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    max_len: int | None = None,
    engine: Engine | None = None,
    timeout_s: float = 3600.0,
    vocab_limit: int | None = None,
    kv_pages: int | None = None,
    page_size: int = 16,
) -> list[Completion]:
    """Complete every prompt (lists of token ids); returns one ``Completion`` per prompt, in order.

    ``model`` is a ``Qwen3`` (an engine with ``num_slots`` slots is built) or ignored when
    ``engine`` is given. Request i samples with seed ``seed + i``, so results do not depend on
    ``num_slots``, on which slot a prompt lands in, or on preemption. ``kv_pages`` (default:
    sized from memory, see ``serving.sizing``) caps the KV pool; when it is too small for
    every admitted request to grow, the youngest requests are preempted and resumed later,
    with the same results. Identical prompts share their prefill. ``timeout_s`` bounds the
    whole call (``TimeoutError``). ``vocab_limit``: ids at or past it (embedding padding
    beyond the tokenizer) are never sampled."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if engine is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        engine = Engine(model, num_slots=min(num_slots, len(prompts)),
                        max_len=max_len or longest, vocab_limit=vocab_limit,
                        kv_pages=kv_pages or 0, page_size=page_size)
    stops = tuple(stop_ids or ())
    episodes = [_OneTurn(p, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                           seed=seed + i, max_new_tokens=max_new_tokens,
                                           stop_ids=stops))
                for i, p in enumerate(prompts)]
    # No growth reserve: admit whatever the pool holds now, preempt when it runs out.
    RolloutScheduler([engine], max_rollout_len=engine.max_len, admit_reserve_tokens=0,
                     timeout_s=timeout_s).run(episodes)
    return [ep.out for ep in episodes]


class TextStream:
    """Incremental detokenization of one request's streamed ids: each ``add`` returns the text
    that is now stable, holding back the bytes of a character split across tokens (an emoji,
    a rare CJK character: byte-level BPE splits them into partial UTF-8 tokens) until it
    completes; ``finish`` returns what is left. The pieces joined are always exactly
    ``tokenizer.decode(every id added)`` (its ``errors="replace"``: bytes that never form a
    character become U+FFFD there too), where decoding each token alone would turn every
    split character into U+FFFD. The stable-prefix rule of HF's ``TextStreamer`` and vLLM's
    detokenizer, on the bytes of the byte-level tokenizer (an incremental UTF-8 decoder), so a
    token costs its own bytes, not a decode of everything so far."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Sequence[int]) -> str:
        ids = [int(t) for t in ids]
        if not ids:
            return ""
        return self._utf8.decode(self.tokenizer.decode_bytes(ids), final=False)

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)
