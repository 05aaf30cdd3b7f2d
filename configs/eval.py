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

from rstarjax.recipes.config import section_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402


def get_config(arg=None):
    if arg:  # this preset has one form; a typo (configs/eval.py:x) would otherwise pass unnoticed
        raise ValueError(f"configs/eval.py takes no variant, got {arg!r}: use --config=configs/eval.py")
    c = base.get_config("rl")
    c.mode = "eval"
    # rStar2-Agent §5.1's k=16 samples at temperature 0.6, up to 30K tokens and 30 turns:
    # EvalConfig's defaults (rstarjax/recipes/config.py, whose field comments document each key)
    c.eval = section_config("eval")
    return c
