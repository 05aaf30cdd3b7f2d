"""Result types shared by the executor (trainer side), the workers and the tool layer.

Kept free of any import beyond the standard library: the zygote loads this module too.
"""
from __future__ import annotations

import dataclasses

# rStar2-Agent §2.1: the environment answers a tool call with exactly one of four responses.
STDOUT = "stdout"  # successful execution with standard output
DISPLAY = "display"  # successful execution without standard output: IPython-style repr of the last expression
ERROR = "error"  # execution error: compact message and traceback
TIMEOUT = "timeout"  # the code did not finish within its wall-clock limit
RESULT_KINDS = (STDOUT, DISPLAY, ERROR, TIMEOUT)


def valid_unicode(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (surrogate pairs joined). Model code
    can put lone surrogates into an exception message; JSON carries them, but encoding such a
    string to UTF-8 raises, far from where it came from."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@dataclasses.dataclass
class ExecResult:
    """The outcome of one code execution.

    `infra_error` marks failures of the environment rather than of the model's code (a worker
    died, the queue timed out, the executor was closed); they are still kind "error" so the model
    sees a response, but a trainer may want to count them apart (they are environment noise).
    """

    kind: str
    text: str
    duration_s: float = dataclasses.field(default=0.0, compare=False)  # time in the sandbox (0: never started)
    infra_error: bool = False
    timings: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in RESULT_KINDS:
            raise ValueError(f"ExecResult.kind must be one of {RESULT_KINDS}, got {self.kind!r}")
        self.text = valid_unicode(self.text)

    @property
    def ok(self) -> bool:
        return self.kind in (STDOUT, DISPLAY)


@dataclasses.dataclass
class VerifyResult:
    """Reward verdict computed in the pool. `bool(result)` is the reward (timeouts count as wrong)."""

    correct: bool
    timed_out: bool = False
    error: str = ""  # why the verifier could not decide (crash, infrastructure), "" when it did

    def __bool__(self) -> bool:
        return bool(self.correct)
