"""rstarjax.recipes: the runs (SFT, RL stages, the stage-3 filter, evaluation, the demo)."""
