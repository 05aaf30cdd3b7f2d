"""Non-reasoning SFT (rStar2-Agent §4.1, §5.1): 3 epochs, lr 5e-6, 4 % warm-up then cosine
decay, batch 128 conversations, loss on assistant tokens, packed sequences.

python -m rstarjax.main --config=configs/sft.py --workdir=DIR \
    --config.model.hf_path=Qwen3-14B-Base --config.sft.data_path=sft.jsonl
"""
import os
import sys

from rstarjax.recipes.config import section_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
    if arg:  # this preset has one form; a typo (configs/sft.py:x) would otherwise pass unnoticed
        raise ValueError(f"configs/sft.py takes no variant, got {arg!r}: use --config=configs/sft.py")
    c = base.get_config("rl")
    c.mode = "sft"

    # SFTConfig's defaults (rstarjax/recipes/config.py, whose field comments document each key:
    # §5.1's 3 epochs, lr 5e-6, 4 % warm-up, batch 128) with this run's row length, micro-step
    # and HF export
    c.sft = section_config("sft", seq_len=8192, micro_batch_size=8, export_hf=True)
    c.sft.seed = c.get_ref("seed") + 0  # follows --config.seed (the SFT batch order); set it to untie
    c.checkpoint.every_steps = 200
    return c
