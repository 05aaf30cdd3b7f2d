"""The ``rl`` config section (``RLConfig``): the rollouts of one GRPO-RoC step and what of them
is trained on (rStar2-Agent §2.2.3 / §4.3), read by ``rl.step.rl_step``; it derives the typed
configs the rollout layer takes (``AgentConfig``, ``SamplingParams``).
"""
from __future__ import annotations

import dataclasses

from rstarjax.models.chat_template import CHAT_FORMATS
from rstarjax.rl.agent_loop import AgentConfig
from rstarjax.rl.roc import DEFAULT_ZERO_PENALTY_EPS, ROC_PENALTIES
from rstarjax.serving.sampling import SamplingParams
from rstarjax.validation import one_of, require


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The ``rl`` section: the rollouts of one step and what of them is trained on
    (rStar2-Agent §2.2.3 / §4.3). ``agent()`` and ``sampling()`` are the typed configs the
    rollout layer takes."""

    prompts_per_step: int = 512  # global, over all processes
    group_size: int = 16  # G: rollouts per prompt kept for the update
    oversample: int = 32  # 2G rollouts sampled before RoC down-samples to G
    # the rollouts' budgets and the tool's limits are the rollout layer's (AgentConfig: their
    # defaults are written there, once); ``agent()`` hands this section's values back to it
    max_turns: int = AgentConfig.max_turns  # T: model turns per episode
    max_prompt_len: int = 2048
    max_response_len: int = AgentConfig.max_response_len  # tokens of model + tool text per trajectory
    max_tool_response_chars: int = AgentConfig.max_tool_response_chars
    chat_format: str = "rstar2"  # models.chat_template.CHAT_FORMATS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    # per code execution, in (0, ExecutorConfig.max_timeout]: the code pool's limit per call
    tool_timeout_s: float = AgentConfig.tool_timeout_s
    num_tool_workers: int = 0  # code-pool workers; 0 = one per host core (each runs 4 sandboxes)
    # a whole step's rollouts (> 0); past it the step fails loudly
    rollout_timeout_s: float = AgentConfig.rollout_timeout_s
    roc: bool = True  # False: the paper's GRPO baseline, G rollouts per prompt, all trained
    roc_variant: str = "paper"  # "topk": the official code's deterministic selection, exactly
    # per-class floors of roc_variant="topk" (the official run script's values)
    roc_min_negatives: int = 2
    roc_min_positives: int = 2
    # how RoC's p_total is measured (roc.ROC_PENALTIES): "paper" from the rollout's structured
    # counts (eq. 4-5); "official_text" from the decoded response as the official code does
    # (roc.official_text_penalty; with roc_variant="topk": the official kept set)
    roc_penalty: str = "paper"
    # roc_variant="paper": positives are drawn with weight 1 / (p_total + this) (§2.2.3 says
    # "inversely proportional to p_total", which is infinite at p_total = 0; ours, roc.py)
    roc_zero_penalty_eps: float = DEFAULT_ZERO_PENALTY_EPS
    # rStar2-Agent §4.3 / the official run script: groups whose rewards are all equal are dropped
    # before RoC, without refilling (advantages.is_equal_reward_group)
    reject_equal_reward: bool = True
    # consecutive rollout batches with nothing left to train before the run stops with an error
    max_rejected_batches: int = 20
    # DAPO dynamic sampling (selection.informative_groups): drop groups whose kept rewards are all
    # equal and refill from the data, at most dynamic_sampling_max_rounds rollout rounds per step,
    # the first included (verl's max_num_gen_batches); 1 = drop without refilling.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 3
    # DAPO overlong filtering: truncated rollouts get loss mask 0 (the paper found it harmful, §4.3.1)
    overlong_filter: bool = False
    length_penalty_coef: float = 0.0  # Kimi k1.5 length reward (advantages.kimi_length_reward); 0 = off
    # Kimi k1.5 partial rollouts (rl.partial): the most tokens one rollout samples in one step; one
    # that has not finished by then is paused and continued in the next step under the new
    # weights, and a group is trained once all its rollouts finished. 0 = off (the paper's loop)
    partial_rollout_tokens: int = 0
    # True: a paused rollout is re-prefilled under the new weights; False (as slime and SkyRL): it
    # decodes on from the KV it kept, computed by the weights that sampled its earlier tokens
    partial_reprefill: bool = False
    # bounded-staleness asynchronous rollouts (rl.staleness): a rollout thread samples the next
    # steps while the update runs, and no rollout is trained more than max_staleness policy
    # versions after the one that sampled it (with partial rollouts: its last round's tokens; a
    # paused rollout's earlier ones at most one version more per round between). 0 = off (the paper's loop)
    max_staleness: int = 0

    def __post_init__(self):
        floors = self.roc_min_negatives + self.roc_min_positives
        rounds = self.dynamic_sampling_max_rounds
        workers = self.num_tool_workers
        rules = [
            (self.group_size >= 2, f"group_size={self.group_size}: GRPO needs G >= 2 rollouts per prompt"),
            (not self.roc or self.oversample == 2 * self.group_size,
             f"oversample={self.oversample} must be 2 * group_size = {2 * self.group_size} with RoC "
             "(rStar2-Agent §2.2.3 samples 2G and keeps G); or set rl.roc=False (the GRPO "
             "baseline samples group_size rollouts and trains on all of them)"),
            one_of("roc_variant", self.roc_variant, ("paper", "topk")),
            one_of("roc_penalty", self.roc_penalty, ROC_PENALTIES),
            (isinstance(self.roc_zero_penalty_eps, (int, float)) and self.roc_zero_penalty_eps > 0
             and self.roc_zero_penalty_eps == self.roc_zero_penalty_eps < float("inf"),
             f"roc_zero_penalty_eps={self.roc_zero_penalty_eps!r} must be a finite number > 0 (a trace with "
             "p_total = 0 would get an infinite weight)"),
            (not (self.roc and self.roc_variant == "topk")
             or (min(self.roc_min_negatives, self.roc_min_positives) >= 0 and floors <= self.group_size),
             f"roc_min_negatives + roc_min_positives = {floors} must lie in [0, group_size={self.group_size}] "
             "(the official code asserts the same)"),
            (self.prompts_per_step >= 1, f"prompts_per_step={self.prompts_per_step} must be >= 1"),
            (self.max_prompt_len >= 1, f"max_prompt_len={self.max_prompt_len} must be >= 1"),
            (self.max_rejected_batches >= 1, f"max_rejected_batches={self.max_rejected_batches} must be >= 1"),
            (isinstance(rounds, int) and rounds >= 1,
             f"dynamic_sampling_max_rounds={rounds!r} must be an integer >= 1 (rollout rounds per step, the "
             "first included; 1 = drop zero-variance groups without refilling)"),
            one_of("chat_format", self.chat_format, CHAT_FORMATS),
            (isinstance(workers, int) and workers >= 0,
             f"num_tool_workers={workers!r} must be an integer >= 0 (0 = one per host core)"),
            (self.length_penalty_coef >= 0, f"length_penalty_coef={self.length_penalty_coef} must be >= 0"),
            (isinstance(self.partial_rollout_tokens, int) and self.partial_rollout_tokens >= 0,
             f"partial_rollout_tokens={self.partial_rollout_tokens!r} must be an integer >= 0 (0 = off)"),
            (isinstance(self.partial_reprefill, bool),
             f"partial_reprefill={self.partial_reprefill!r} must be True or False"),
            (isinstance(self.max_staleness, int) and self.max_staleness >= 0,
             f"max_staleness={self.max_staleness!r} must be an integer >= 0 (0 = the synchronous loop)"),
            (not (self.max_staleness and self.dynamic_sampling),
             "max_staleness does not combine with dynamic_sampling yet: a dynamic-sampling step refills "
             "from the data until it holds its quota, while the rollout thread draws each round ahead"),
            (not (self.partial_rollout_tokens and self.dynamic_sampling),
             "partial_rollout_tokens and dynamic_sampling do not combine: a partial step trains the groups "
             "that completed, a dynamic-sampling step refills until it holds its quota; turn one off"),
        ]
        try:  # the rollout layer's own rules on the values it takes from this section
            self.agent(), self.sampling()
        except ValueError as e:
            rules += [(False, line) for line in str(e).splitlines()]
        require(*rules)

    @property
    def seq_len(self) -> int:
        return self.max_prompt_len + self.max_response_len

    @property
    def rollouts_per_prompt(self) -> int:
        """2G with RoC (it keeps G of them); G for the GRPO baseline, which trains on all it samples."""
        return self.oversample if self.roc else self.group_size

    def agent(self, reward_mode: str = AgentConfig.reward_mode, **budgets) -> AgentConfig:
        """The rollout layer's ``AgentConfig``, the one place it is derived from a run's config:
        this section's budgets and tool limits, ``budgets`` over them (an evaluation's
        max_turns, max_response_len and rollout_timeout_s: ``EvalConfig.budgets``) and the run's
        ``reward_mode`` (the ``reward`` section's; ``RunConfig.agent`` passes it)."""
        # the scheduler's wait for a tool call's answer covers the call's own limit twice over
        # (queueing included): a long tool_timeout_s is not cut short as an infrastructure error
        tool_wait_s = max(AgentConfig.tool_wait_s, 2 * self.tool_timeout_s)
        fields = dict(max_turns=self.max_turns, max_response_len=self.max_response_len,
                      rollout_timeout_s=self.rollout_timeout_s, tool_timeout_s=self.tool_timeout_s,
                      max_tool_response_chars=self.max_tool_response_chars, tool_wait_s=tool_wait_s)
        return AgentConfig(**{**fields, **budgets}, reward_mode=reward_mode)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k))
