"""rstarjax.serving."""
