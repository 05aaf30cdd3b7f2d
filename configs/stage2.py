"""RL stage 2 (rStar2-Agent §4.3): same data, response length extended to 12K, T=10.

Continues stage 1 (params, optimizer, global step) in its own --workdir:
--config.checkpoint.init_from=STAGE1_WORKDIR/checkpoints. It ends at global step 385 (the paper
filters stage-3 data with the policy "from the final 385 steps of Stage 2", and 300 + 85 + 125 =
510 steps in all), and reads the data in a new order (docs/training.md "Stage hand-offs").
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
    c = base.get_config(arg)
    c.total_steps = 385
    c.rl.max_turns = 10
    c.rl.max_response_len = 12 * 1024
    return c
