"""The tiny RL run the end-to-end tests start from, built in one place (issue 49).

configs/base.py with the tiny preset's random weights in float32 without remat, 2 prompts x 2G = 4
rollouts -> G = 2 with 8-token prompts and 8-token responses, the problems at ``train_path``, no
progress bar. ``in_process``: the run happens inside the test process: a one-device mesh, no
TensorBoard, each checkpoint written before its step returns. ``changes``: the dotted keys a test
is about (``"rl.group_size"``, ``"checkpoint.every_steps"``, ``"seed"``), as keyword arguments:
``tiny_rl_config(path, 3, **{"rl.max_staleness": 1})``.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
import base  # noqa: E402


def set_keys(c, changes: dict) -> None:
    """Write dotted keys (``"rl.max_turns"``; a top-level one such as ``"seed"``) into ``c``."""
    for dotted, value in changes.items():
        *sections, key = dotted.split(".")
        node = c
        for name in sections:
            node = node[name]
        node[key] = value


def tiny_rl_config(train_path, total_steps: int, *, in_process: bool = True, **changes):
    c = base.get_config()
    c.total_steps = total_steps
    c.model.preset, c.model.random_init, c.model.dtype, c.model.remat_policy = "tiny", True, "float32", "none"
    c.data.train_path = str(train_path)
    c.rl.prompts_per_step, c.rl.group_size, c.rl.oversample = 2, 2, 4
    c.rl.max_prompt_len, c.rl.max_response_len = 8, 8
    c.logging.progress_bar = False
    if in_process:
        c.mesh.fsdp = 1
        c.logging.tensorboard = False
        c.checkpoint.async_save = False
    set_keys(c, changes)
    return c
