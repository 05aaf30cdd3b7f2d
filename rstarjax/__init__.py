"""rstarjax: agentic reinforcement learning (rStar2-Agent's GRPO-RoC) in JAX/Flax.

Packages, imports only pointing down the list (docs/design.md has the map):
``recipes`` (the runs: SFT, RL stages, filter, eval, the demo and its GRPO-RoC vs GRPO
comparison) -> ``rl`` (the algorithm) and ``io`` (data, checkpoints, metrics log) -> ``serving``
(slot engine, scheduler) -> ``models`` (policy, tokenizer, chat template); ``env`` (sandboxed
Python tool, verifier) stands alone. ``protocol`` (the tool protocol) and ``validation`` (config
rules) import nothing and serve every layer.
"""

__version__ = "0.1.0"
