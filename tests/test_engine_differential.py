"""The serving engine against a full forward, over generated workloads (issue 31).

Each workload is drawn from a seed: prompts that share whole pages but differ in their last
one (a templated head), identical prompts, groups of 2G samples, short prompts, greedy and
sampled requests, one to three model turns with tool responses appended by ``extend``. The
rollout scheduler drives it through an engine whose pool was dirtied by the workloads before
it, with few slots (groups split over several ``start`` calls, so prompts share pages within a
call and across calls), ``k``-step decode calls, and in some lanes a page budget tight enough
that rollouts are preempted and resumed. Lanes vary the decode attention (the reference, the
portable ragged path, each Pallas kernel in its interpreter) and the placement (one device, a
tensor-parallel slice of the simulated CPU devices).

The check is independent of the engine: one uncached forward of the model over every finished
conversation. Every token a greedy request sampled is the argmax of that forward at its
position (so the greedy continuation is the full forward's argmax decoding, token by token),
and every recorded log-prob, greedy or sampled, is the forward's within 1e-4 (float32).
"""
import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.serving import Engine, RolloutScheduler, SamplingParams, slice_meshes
from rstarjax.serving.scheduler import CallTool, Extend, Finish
from model_support import chaotic, full_forward_logprobs, poison_pool

MAX_LEN = 64
PAGE = 8
SLOTS = 4
BUCKETS = (16, 64)  # the shapes of tests/test_engine.py: one process compiles them once
VOCAB = 512
LOGPROB_TOL = 1e-4
TIE_TOL = 1e-5  # a greedy token within this of the forward's best log-prob is a float tie
REF_ROWS = 16  # conversations per reference forward (one compiled shape)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32)
    return chaotic(Qwen3(cfg, rngs=nnx.Rngs(0)), seed=31)


# ---- workloads --------------------------------------------------------------------------------

@dataclasses.dataclass
class Conversation:
    """One rollout (a ``scheduler.Episode``): ``len(turn_lens)`` model turns of a fixed number of
    sampled tokens each, separated by tool responses that are ready at once. Records the whole
    conversation and, per sampled token, its position, id and the engine's log-prob."""

    prompt_ids: list[int]
    sampling: SamplingParams
    turn_lens: list[int]
    tool_ids: list[list[int]]  # one response after each turn but the last
    convo: list[int] = dataclasses.field(default_factory=list)
    sampled: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
    turns_done: int = 0

    def __post_init__(self):
        self.convo = list(self.prompt_ids)

    @property
    def greedy(self) -> bool:
        return self.sampling.temperature == 0

    def forced_token(self, offset: int) -> int:
        return -1

    def on_turn_end(self, ids, logprobs, reason):
        for tok, lp in zip(ids, logprobs):
            self.sampled.append((len(self.convo), int(tok), float(lp)))
            self.convo.append(int(tok))
        self.turns_done += 1
        if self.turns_done == len(self.turn_lens):
            return Finish()
        ready = concurrent.futures.Future()
        ready.set_result(self.tool_ids[self.turns_done - 1])
        return CallTool(ready)

    def on_tool_ready(self, ids, free_tokens_in_slot):
        self.convo += list(ids)
        return Extend(ids, max_new_tokens=self.turn_lens[self.turns_done])

    def on_abort(self, why):
        raise AssertionError(f"rollout aborted: {why}")


def _tokens(rng, n: int) -> list[int]:
    return rng.integers(1, VOCAB, size=int(n)).tolist()


def _conversation(rng, prompt: list[int], greedy: bool, seed: int, max_turns: int) -> Conversation:
    turn_lens = [int(rng.integers(1, 7)) for _ in range(int(rng.integers(1, max_turns + 1)))]
    # The first turn's budget is the request's; later turns get theirs with each ``Extend``.
    sampling = SamplingParams(temperature=0.0 if greedy else 1.0, seed=seed,
                              max_new_tokens=turn_lens[0])
    return Conversation(prompt, sampling, turn_lens,
                        [_tokens(rng, rng.integers(1, 6)) for _ in range(len(turn_lens) - 1)])


def workload(seed: int, num_prompts: int = 6, max_turns: int = 3) -> list[Conversation]:
    """Prompt groups in queue order (the scheduler admits consecutive equal prompts together):
    runs of different prompts with one whole-page head (1 to 3 pages; tails of 0 to 6
    tokens, so some end on a page boundary), groups of 2G = 4 samples of one prompt, and
    prompts shorter than a page; a group is greedy or sampled at temperature 1. At most
    30 + 3 * 6 + 2 * 5 = 58 tokens per conversation: every one fits a 64-token slot."""
    rng = np.random.default_rng(seed)
    # Heads of 1 to 3 pages: a head-sharing prompt of more than 16 tokens is fed in a bigger
    # token bucket, hence in another feed call, than the short tails that share its pages.
    heads = [_tokens(rng, PAGE * rng.integers(1, 4)) for _ in range(2)]
    groups: list[tuple[list[int], int]] = []  # (prompt, samples)
    while len(groups) < num_prompts:
        kind = rng.choice(["templated", "2G", "short"], p=[0.5, 0.3, 0.2])
        if kind == "templated":
            head = heads[int(rng.integers(len(heads)))]
            for _ in range(int(rng.integers(2, 4))):
                groups.append((head + _tokens(rng, rng.integers(0, 7)), int(rng.integers(1, 3))))
        elif kind == "2G":
            groups.append((_tokens(rng, rng.integers(3, 20)), 4))
        else:
            groups.append((_tokens(rng, rng.integers(1, PAGE)), 1))
    out = []
    for prompt, samples in groups:
        greedy = bool(rng.random() < 0.6)
        out += [_conversation(rng, prompt, greedy, 1000 * seed + len(out), max_turns)
                for _ in range(samples)]
    return out


# ---- the reference ----------------------------------------------------------------------------

def reference_logprobs(model: Qwen3, convos: list[list[int]]) -> list[np.ndarray]:
    """The uncached forward's log-probs of each whole conversation (``model_support``)."""
    return full_forward_logprobs(model, convos, rows=REF_ROWS, width=MAX_LEN)


def mismatches(model: Qwen3, convos: list[Conversation], logprob_tol: float = LOGPROB_TOL,
               tie_tol: float = TIE_TOL) -> list[str]:
    """Every sampled token that disagrees with the full forward: a greedy token that is not
    its argmax (up to a tie within ``tie_tol``), or a log-prob off by more than
    ``logprob_tol``."""
    refs = reference_logprobs(model, [c.convo for c in convos])
    bad = []
    for i, (c, ref) in enumerate(zip(convos, refs)):
        assert len(c.sampled) == sum(c.turn_lens), f"conversation {i} did not finish"
        for pos, tok, lp in c.sampled:
            row = ref[pos - 1]  # the logits at pos - 1 predict the token at pos
            best = int(np.argmax(row))
            if c.greedy and tok != best and row[best] - row[tok] > tie_tol:
                bad.append(f"conversation {i} position {pos}: greedy token {tok}, full-forward "
                           f"argmax {best} (log-probs {row[tok]:.4f} vs {row[best]:.4f})")
            elif abs(lp - row[tok]) > logprob_tol:
                bad.append(f"conversation {i} position {pos}: log-prob {lp:.6f}, full forward "
                           f"{row[tok]:.6f}")
    return bad


# ---- lanes: engine placements and attention paths ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class Lane:
    decode_attention: str
    tensor_parallel: int = 1
    kv_pages: int = 0  # 0: room for every slot; else a budget that forces preemption
    decode_steps: int = 8  # the engine's; scheduler calls run k of them
    ks: tuple[int, ...] = (8, 1, 4)  # k per seed, cycled
    seeds: tuple[int, ...] = (0, 1, 2)
    num_prompts: int = 6
    max_turns: int = 3
    # The TPU kernel rounds K and V to bfloat16 before its dots (jax's paged_attention_kernel,
    # on a real TPU too): its lane cannot hold float32's 1e-4, and near-ties may flip.
    logprob_tol: float = LOGPROB_TOL
    sampler: str = "exact"  # serving.sampling.SAMPLERS

    def engine(self, model) -> Engine:
        placement = {}
        if self.tensor_parallel > 1:
            [mesh] = slice_meshes(jax.devices()[: self.tensor_parallel],
                                  tensor_parallel=self.tensor_parallel, num_slices=1)
            placement["mesh"] = mesh
        return Engine(model, num_slots=SLOTS, max_len=MAX_LEN, buckets=BUCKETS, page_size=PAGE,
                      cache_dtype=jnp.float32, kv_pages=self.kv_pages,
                      decode_steps=self.decode_steps, decode_attention=self.decode_attention,
                      interpret=self.decode_attention.startswith("pallas"),
                      sampler=self.sampler, **placement)


LANES = {
    # one device, a roomy pool, the CPU default path: the most seeds
    "ragged": Lane("ragged", seeds=(0, 1, 2, 3, 4)),
    # 10 pages of 8 tokens for 4 slots of up to 58 tokens: preempted and resumed
    "reference-tight": Lane("reference", kv_pages=10, ks=(4, 2), seeds=(6, 7, 8)),
    "ragged-tp2-tight": Lane("ragged", tensor_parallel=2, kv_pages=10, ks=(4,), seeds=(9, 10)),
    "pallas_gpu": Lane("pallas_gpu", decode_steps=4, ks=(4,), seeds=(11,), num_prompts=4),
    # our kernel writing the step's K/V itself (models/decode_kernel.py: pallas_gpu_packed's page
    # reads but the last token's) and the one-pass sampler together (issue 46)
    # (one short workload, as the TPU lane: the interpreter's decode steps are slow)
    "packed-append-fused": Lane("pallas_gpu_packed_append", decode_steps=4, ks=(4,), seeds=(13,),
                                num_prompts=2, max_turns=2, sampler="fused"),
    # the same kernel norming and rotating q and k itself, with the exact sampler
    "packed-rope": Lane("pallas_gpu_packed_rope", decode_steps=4, ks=(4,), seeds=(14,),
                        num_prompts=2, max_turns=2),
    # that kernel with the layer's projections as our fused GEMMs (models/decode_gemm.py)
    "packed-layer": Lane("pallas_gpu_packed_layer", decode_steps=4, ks=(4,), seeds=(15,),
                         num_prompts=2, max_turns=2),
    # The TPU interpreter takes ~1.5 s per decode step here: one short workload.
    "pallas_tpu": Lane("pallas_tpu", decode_steps=4, ks=(4,), seeds=(12,), num_prompts=2,
                       max_turns=2, logprob_tol=2e-2),
}


def run_lane(model, lane: Lane) -> tuple[list[Conversation], int]:
    """Every seed's workload through one engine, in turn, on a pool full of junk at first and
    dirtied by the earlier seeds' rollouts after. Returns the conversations and the
    preemptions."""
    engine = lane.engine(model)
    poison_pool(engine, lane.seeds[0])
    convos, preemptions = [], 0
    for i, seed in enumerate(lane.seeds):
        work = workload(seed, lane.num_prompts, lane.max_turns)
        stats = RolloutScheduler([engine], max_rollout_len=MAX_LEN, admit_reserve_tokens=0,
                                 decode_steps=lane.ks[i % len(lane.ks)]).run(work)
        preemptions += stats.slices[0].preemptions
        assert engine.pages.num_free == engine.num_pages  # every page returned
        convos += work
    return convos, preemptions


@pytest.mark.parametrize("name", list(LANES))
def test_engine_equals_full_forward_on_generated_workloads(model, name):
    lane = LANES[name]
    convos, preemptions = run_lane(model, lane)
    if lane.kv_pages:
        assert preemptions > 0, "the page budget should have forced preemption"
    loose = lane.logprob_tol > LOGPROB_TOL
    bad = mismatches(model, convos, lane.logprob_tol, lane.logprob_tol if loose else TIE_TOL)
    tokens = sum(len(c.sampled) for c in convos)
    assert not bad, f"{len(bad)} of {tokens} sampled tokens differ:\n" + "\n".join(bad[:20])


def test_workloads_hold_what_the_differential_test_needs():
    """The generator really draws the cases the lanes rely on (else the engine test could pass
    by never meeting them)."""
    convos = [c for seed in LANES["ragged"].seeds for c in workload(seed)]
    prompts = [tuple(c.prompt_ids) for c in convos]
    heads = {}
    for p in set(prompts):
        if len(p) >= PAGE:
            heads.setdefault(p[: len(p) // PAGE * PAGE], set()).add(p)
    assert any(len(ps) > 1 for ps in heads.values()), "different prompts sharing whole pages"
    assert any(prompts.count(p) == 4 for p in prompts), "groups of 2G samples"
    assert any(len(p) % PAGE == 0 for p in prompts), "prompts ending on a page boundary"
    assert any(len(p) < PAGE for p in prompts), "prompts shorter than a page"
    assert any(len(c.turn_lens) == 3 for c in convos), "multi-turn conversations"
    assert {c.greedy for c in convos} == {True, False}
    assert max(len(c.prompt_ids) + sum(c.turn_lens) + sum(map(len, c.tool_ids))
               for c in convos) <= MAX_LEN
