"""rstarjax.rl."""
