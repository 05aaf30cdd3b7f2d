"""Shared defaults for every rstarjax run (rStar2-Agent §4.3 / §5.1 unless noted).

Each key and its default is written once, in its section's typed dataclass, whose field comments
document it (``rstarjax/recipes/config.py`` SECTIONS says which dataclass parses which section:
``rl`` -> rstarjax/rl/config.py RLConfig, ``loss`` -> rstarjax/rl/loss.py LossConfig,
``serving`` -> rstarjax/serving/colocated.py ServingConfig, ...); the top-level keys (seed,
profile, total_steps, compilation_cache_dir) are RunConfig's. ``get_config()`` here is those
defaults with the few a run at the paper's scale sets otherwise. Presets (stage1.py, stage2.py,
stage3.py, ...) start from it and change a few fields. Paths that must come from the user (model,
data) default to "" and are rejected at start with a message that names the flag to set.

`--config=configs/base.py:filter` selects a mode through the config argument.
"""
from rstarjax.recipes.config import default_config


def get_config(arg=None):
    c = default_config(arg or "rl")  # rl | filter (sft / eval / demo are added by their own presets)
    # global rows per gradient-accumulation micro-step: a 512 x 16-row step accumulates (the
    # trainer's own default, 0, takes a whole mini-batch in one micro-step)
    c.trainer.micro_batch_size = 64
    return c
