"""How ``Engine.start`` runs a batch of requests: which requests share one prefill (the same
all-prompt history), and which pages each group shares instead of writing them again (pages
of the prefix registry written by an earlier call under the same weights, or pages an earlier
group of the same call writes). Host-side planning only: the engine takes the pages and feeds.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from rstarjax.models.kv_cache import pages_for
from rstarjax.serving.pages import PagePool
from rstarjax.serving.sampling import SamplingParams


@dataclasses.dataclass
class StartRequest:
    """Start a request in ``slot``: its cache must hold ``history``, then a token is sampled
    (or ``forced``). Requests with the same ``history`` that is all prompt
    (``prompt_len == len(history)``) share one prefill. The whole pages of the first
    ``prompt_len`` tokens (a prompt, or a rollout resumed after preemption) reuse pages that
    hold the same tokens: another group's of the same call (which is fed first), or those a
    live slot holds, written under the weights being served."""

    slot: int
    history: Sequence[int]
    sampling: SamplingParams
    prompt_len: int = 0
    counter: int = 0  # tokens the request sampled before this one (RNG stream index)
    budget: int | None = None  # tokens it may sample from here, this one included
    forced: int = -1

    @property
    def start_budget(self) -> int:
        """Tokens it may sample from here, this one included (default: what is left of
        ``sampling.max_new_tokens``)."""
        return self.sampling.max_new_tokens - self.counter if self.budget is None else int(self.budget)


@dataclasses.dataclass
class StartGroup:
    """How ``Engine.start`` runs the requests of one prompt (``plan_start``)."""

    leader: StartRequest  # its row feeds the leader's history; the members sample from it
    members: list[StartRequest]
    registered: tuple[int, ...] = ()  # pages from the prefix registry (written by earlier calls)
    writer: int | None = None  # an earlier group of the call whose new pages this one shares
    num_shared: int = 0  # leading pages shared (from the registry or the writer)
    writes_prefix: bool = False  # registers its prompt's full pages once its feed ran


def start_cost(plan: Sequence[StartGroup], page_size: int) -> int:
    """Pages a ``start`` plan takes: each leader's pages less the shared ones, plus a copy of
    the partial last page for every other member."""
    total = 0
    for g in plan:
        n = len(g.leader.history)
        total += pages_for(n, page_size) - g.num_shared
        total += (len(g.members) - 1) * (1 if n % page_size else 0)
    return total


def group_requests(requests: Sequence[StartRequest], max_len: int
                   ) -> list[tuple[StartRequest, list[StartRequest]]]:
    """(leader, members) per distinct fresh prompt; other requests stand alone."""
    groups: dict[tuple, list[StartRequest]] = {}
    out = []
    for r in requests:
        if len(r.history) < 1:
            raise ValueError("a request needs at least one token of history")
        if len(r.history) > max_len:
            raise ValueError(f"history of {len(r.history)} tokens exceeds max_len {max_len}")
        if r.start_budget < 1:  # its first token would be sampled past its budget
            raise ValueError(f"a request needs a budget of at least one token, got {r.start_budget}")
        if r.prompt_len == len(r.history):
            key = tuple(int(t) for t in r.history)
            if key in groups:
                groups[key].append(r)
                continue
            groups[key] = [r]
            out.append(groups[key])
        else:
            out.append([r])
    return [(members[0], members) for members in out]


def plan_start(requests: Sequence[StartRequest], pages: PagePool, max_len: int,
               version: int | None) -> list[StartGroup]:
    """Which pages each group of ``start(requests)`` shares: registered pages written by an
    earlier call under weights ``version`` (None: weights other than the served copy's, whose
    pages are neither registered nor looked up), else the pages an earlier group of this call
    writes for the same full-page prompt head (that group then runs first), else none."""
    plan, writer_of = [], {}
    for leader, members in group_requests(requests, max_len):
        group = StartGroup(leader, members)
        head = pages.full_prefix_key(leader.history[: leader.prompt_len])
        # At least the last token is fed again: its logits are what the first token samples.
        shareable = min(len(head), len(leader.history) - 1) // pages.page_size
        registered = () if version is None or not head else pages.lookup_prefix(
            head, version=version)
        if registered:
            group.registered = registered[:shareable]
            group.num_shared = len(group.registered)
        elif head in writer_of and shareable:
            group.writer, group.num_shared = writer_of[head], shareable
        elif head and head not in writer_of:
            writer_of[head] = len(plan)
            group.writes_prefix = True
        plan.append(group)
    return plan
