"""RL stage 1 (rStar2-Agent §4.3): all 42K problems, 8K response length, T=10 turns, 300 steps,
512 prompts x 2G=32 rollouts -> G=16 after RoC, lr 1e-6.

From the SFT policy: --config.checkpoint.init_from=SFT_WORKDIR/checkpoints gives its params only
(global step 0, a fresh optimizer, the LR warmup); see docs/training.md "Stage hand-offs".
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
    c = base.get_config(arg)
    c.total_steps = 300
    c.rl.prompts_per_step = 512
    c.rl.oversample = 32
    c.rl.group_size = 16
    c.rl.max_turns = 10
    c.rl.max_response_len = 8 * 1024
    c.optim.learning_rate = 1e-6
    return c
