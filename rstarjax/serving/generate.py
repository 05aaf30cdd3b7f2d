"""``generate``: batch completion through the slot engine, refilling slots as requests finish."""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import numpy as np

from rstarjax.serving.engine import DoneReason, Engine
from rstarjax.serving.sampling import SamplingParams


@dataclasses.dataclass
class Completion:
    token_ids: list[int]  # sampled ids, stop id included when it stopped on one
    logprobs: list[float]  # policy log-prob of each sampled id
    finish: str  # "stop" | "length" | "context"
    prompt_len: int = 0


_FINISH = {DoneReason.STOP: "stop", DoneReason.BUDGET: "length", DoneReason.CONTEXT: "context"}


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
) -> list[Completion]:
    """Complete every prompt (lists of token ids); returns one ``Completion`` per prompt, in order.

    ``model`` is a ``Qwen3`` (an engine with ``num_slots`` slots is built) or ignored when
    ``engine`` is given. Request i samples with seed ``seed + i``, so results do not depend on
    ``num_slots`` or on which slot a prompt lands in. Slots are refilled the step a request
    finishes. ``timeout_s`` bounds the whole call (``TimeoutError``). ``vocab_limit``: ids at or
    past it (embedding padding beyond the tokenizer) are never sampled."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if engine is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        engine = Engine(model, num_slots=min(num_slots, len(prompts)),
                        max_len=max_len or longest, vocab_limit=vocab_limit)
    stops = tuple(stop_ids or ())
    params = engine.params
    state = engine.init_decode_state()
    queue = collections.deque(range(len(prompts)))
    out: list[Completion | None] = [None] * len(prompts)
    slot_req: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s

    def admit(state):
        while queue and engine.free_slots():
            i = queue.popleft()
            sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + i,
                                max_new_tokens=max_new_tokens, stop_ids=stops)
            prefix = engine.prefill(params, prompts[i], sampling=sp)
            comp = Completion([prefix.token], [prefix.logprob], "", len(prompts[i]))
            out[i] = comp
            if prefix.done != DoneReason.NOT_DONE:
                comp.finish = _FINISH[prefix.done]
                continue
            slot = engine.free_slots()[0]
            state = engine.insert(prefix, state, slot)
            slot_req[slot] = i
        return state

    state = admit(state)
    while slot_req:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generate did not finish within {timeout_s} s")
        state, res = engine.generate(params, state)
        for slot in list(slot_req):
            if not res.valid[slot]:
                continue
            comp = out[slot_req[slot]]
            comp.token_ids.append(int(res.tokens[slot]))
            comp.logprobs.append(float(res.logprobs[slot]))
            if res.done[slot]:
                comp.finish = _FINISH[DoneReason(int(res.done[slot]))]
                engine.free_resource(slot)
                del slot_req[slot]
        state = admit(state)
    return out  # type: ignore[return-value]
