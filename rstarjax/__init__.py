"""rstarjax: agentic reinforcement learning (rStar2-Agent's GRPO-RoC) in JAX/Flax.

Rooms: ``models`` (policy, tokenizer, HF I/O), ``serving`` (slot engine, scheduler),
``env`` (sandboxed Python tool, verifier), ``rl`` (rollouts, RoC, losses, trainers).
Imports only point downward: env knows nothing of models; models nothing of rl.
"""

__version__ = "0.1.0"
