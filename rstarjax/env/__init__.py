"""rstarjax.env."""
