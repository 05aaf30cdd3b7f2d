"""rstarjax.models."""
