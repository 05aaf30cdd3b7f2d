"""RL stage 3 (rStar2-Agent §4.3): hard problems only, 12K response length, T=15 turns.

Data: the stage-2 policy's filtered set (``--config=configs/stage3.py:filter`` writes it: k=8
rollouts per problem, problems solved 8/8 dropped). Optimizer state is reset (params and global
step come from --config.checkpoint.init_from=STAGE2_WORKDIR/checkpoints; the fresh optimizer's LR
warmup runs again) and the reference model is set to the latest policy (used only with
loss.kl_coef > 0). 125 steps (global steps 385 -> 510).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
    c = base.get_config(arg)
    c.total_steps = 510
    c.rl.max_turns = 15
    c.rl.max_response_len = 12 * 1024
    c.checkpoint.reset_optimizer = True
    c.checkpoint.update_reference = True
    c.filter.k = 8
    return c
