"""Evaluation (rStar2-Agent §5.1): 16 samples per problem at temperature 0.6, up to 30K tokens
and 30 turns with the Fig. 3 prompt; pass@1 (mean over the 16), maj@16, pass@16 and mean
response length per dataset (Table 4).

python -m rstarjax.main --config=configs/eval.py --workdir=DIR --config.model.hf_path=HF_DIR \
    --config.eval.paths=aime24.jsonl,aime25.jsonl,math500.parquet

The released rStar2-Agent-14B checkpoint, as its own code evaluates it: add
--config.profile=rstar2_official (examples/aime_eval.sh of the official repository: the official
chat template and tool name, greedy decoding (verl's val_kwargs: temperature 0, top-p 1) with 16
samples, 2048 prompt / 30720 response tokens, 5 assistant turns, the official reward on the whole
response; docs/algorithm.md "Where the official code differs" lists every setting).
"""
import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
    c = base.get_config("rl")
    c.mode = "eval"
    c.eval = ml_collections.ConfigDict()
    c.eval.paths = ""  # comma-separated jsonl / parquet benchmark files (AIME / MATH-500 layouts)
    c.eval.names = ()  # dataset names; default the file stems
    c.eval.limit = 0  # > 0: first N problems of each file
    c.eval.k = 16
    c.eval.temperature = 0.6
    c.eval.top_p = 1.0
    c.eval.top_k = -1
    c.eval.max_turns = 30
    c.eval.max_response_len = 30 * 1024
    c.eval.max_prompt_len = 2048
    c.eval.num_slots = 64
    c.eval.timeout_s = 24 * 3600.0
    c.eval.chat_format = "rstar2"
    return c
