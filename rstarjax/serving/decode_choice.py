"""Which decode attention each decode program runs: one for every batch, or one per batch size.

The engine compiles its decode program once per batch bucket (4, 16, 64, 256, ... rows:
``engine._batch_bucket``), so a bucket can run another attention path for no extra compile.
That matters where the best path depends on the batch: a kernel with the layer's GEMMs fused
(``pallas_gpu_packed_layer``) can win where the step reads mostly weights (few rows) and lose
where XLA's GEMMs reach their FLOP peak (many rows; docs/serving.md, "Our decode kernel").

A choice is written as a string, so a config flag holds it (``serving.decode_attention``):

- ``"pallas_gpu_packed_rope"``: that path for every batch;
- ``"pallas_gpu_packed_layer@64,pallas_gpu_packed_rope"``: programs of at most 64 rows run
  ``pallas_gpu_packed_layer``, the larger ones ``pallas_gpu_packed_rope``. Bounds increase
  left to right and the last path has none; a bound is a program's rows (its bucket), not the
  active slots in it.
"""
from __future__ import annotations

import dataclasses

from rstarjax.models.paged_attention import DECODE_IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True)
class DecodeChoice:
    """``paths``: (most rows, attention path) with the bounds increasing; the last bound is
    None (every larger batch)."""
    paths: tuple[tuple[int | None, str], ...]

    def __post_init__(self):
        if not self.paths:
            raise ValueError("a decode choice needs at least one attention path")
        bounds = [most for most, _ in self.paths]
        if bounds[-1] is not None or None in bounds[:-1]:
            raise ValueError(f"{self.spec()!r}: only the last path is unbounded (ARM@ROWS,...,ARM)")
        if any(b < 1 for b in bounds[:-1]) or bounds[:-1] != sorted(set(bounds[:-1])):
            raise ValueError(f"{self.spec()!r}: the row bounds must be >= 1 and increase left to right")
        for _, name in self.paths:
            if name not in DECODE_IMPLEMENTATIONS:
                raise ValueError(f"decode attention {name!r} not in {DECODE_IMPLEMENTATIONS}")

    @classmethod
    def parse(cls, spec: str) -> "DecodeChoice":
        """``"ARM"`` or ``"ARM@ROWS,...,ARM"`` (module doc)."""
        paths = []
        for entry in str(spec).split(","):
            name, at, most = entry.strip().partition("@")
            if at and not most.strip().isdigit():
                raise ValueError(f"decode attention {spec!r}: {entry.strip()!r} should be ARM@ROWS "
                                 f"with ROWS a whole number")
            paths.append((int(most) if at else None, name.strip()))
        return cls(tuple(paths))

    def spec(self) -> str:
        return ",".join(name if most is None else f"{name}@{most}" for most, name in self.paths)

    @property
    def names(self) -> tuple[str, ...]:
        """The distinct paths, in the order written."""
        return tuple(dict.fromkeys(name for _, name in self.paths))

    def for_rows(self, rows: int) -> str:
        """The path a decode program of ``rows`` rows runs."""
        return next(name for most, name in self.paths if most is None or rows <= most)


def decode_choice_from_rows(best: dict[int, str]) -> DecodeChoice:
    """The choice that runs, at each measured batch, the path measured fastest there
    (``best``: rows -> path); a batch between two measured ones takes the larger one's path,
    and neighbours with the same path merge. E.g. {32: a, 64: a, 256: b} -> ``a@64,b``."""
    if not best:
        raise ValueError("no measured batch to choose from")
    batches = sorted(best)
    paths: list[tuple[int | None, str]] = []
    for i, rows in enumerate(batches):
        most = None if i == len(batches) - 1 else rows
        if paths and paths[-1][1] == best[rows]:
            paths[-1] = (most, best[rows])
        else:
            paths.append((most, best[rows]))
    return DecodeChoice(tuple(paths))


def decode_choice_rule(spec: str) -> tuple[bool, str]:
    """The config rule (``validation.require``) that ``spec`` is ``"auto"`` or a valid choice."""
    if spec == "auto":
        return True, ""
    try:
        DecodeChoice.parse(spec)
    except ValueError as e:
        return False, f"decode_attention={spec!r}: {e}; choose 'auto', one of {sorted(DECODE_IMPLEMENTATIONS)}, or ARM@ROWS,...,ARM"
    return True, ""
