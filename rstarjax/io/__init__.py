"""rstarjax.io: data in (problem and chat datasets), checkpoints and metrics out."""
