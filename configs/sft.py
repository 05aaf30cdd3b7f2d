"""Non-reasoning SFT (rStar2-Agent §4.1, §5.1): 3 epochs, lr 5e-6, 4 % warm-up then cosine
decay, batch 128 conversations, loss on assistant tokens, packed sequences.

python -m rstarjax.main --config=configs/sft.py --workdir=DIR \
    --config.model.hf_path=Qwen3-14B-Base --config.sft.data_path=sft.jsonl
"""
import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
    c = base.get_config("rl")
    c.mode = "sft"

    c.sft = ml_collections.ConfigDict()
    c.sft.data_path = ""  # jsonl / parquet of {"messages": [...]} (OpenAI style, with tool calls)
    c.sft.chat_format = "rstar2"  # rstar2 (paper Fig. 3) | compact (demo)
    c.sft.epochs = 3
    c.sft.batch_size = 128
    c.sft.learning_rate = 5e-6
    c.sft.warmup_ratio = 0.04
    c.sft.min_lr_ratio = 0.0
    c.sft.weight_decay = 0.01
    c.sft.grad_clip_norm = 1.0
    c.sft.seq_len = 8192  # packed row length
    c.sft.micro_batch_size = 8  # rows per micro-step (multiple of data*fsdp devices)
    c.sft.max_steps = 0
    c.sft.seed = c.get_ref("seed") + 0  # follows --config.seed (the SFT batch order); set it to untie
    c.sft.compute_dtype = ml_collections.config_dict.placeholder(str)
    c.sft.export_hf = True  # also write WORKDIR/hf at the end
    c.checkpoint.every_steps = 200
    return c
