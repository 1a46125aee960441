"""Coverage: every element of every local parameter written exactly once.

Transforms write whole rows (dim 0) of a parameter, so coverage is kept as row
intervals per parameter: cheap even for large models, and exact, because a
gap or an overlap of intervals is exactly an element written zero or two times.
"""

from __future__ import annotations

from collections.abc import Sequence

from megastart.errors import PlanError
from megastart.loader.mapping.needs import ParamInfo


class CoverageError(PlanError):
    """Some parameter elements were not written, or written twice: the model is half-loaded."""


class Coverage:
    def __init__(self) -> None:
        self._rows: dict[tuple[int, str], list[tuple[int, int]]] = {}

    def record(self, param: ParamInfo, start: int, stop: int) -> None:
        self._rows.setdefault((param.chunk, param.local_name), []).append((start, stop))

    def check(self, params: Sequence[ParamInfo]) -> None:
        """Raise :class:`CoverageError` naming every parameter not written exactly once."""
        problems = []
        for param in params:
            rows = param.shape[0] if param.shape else 1
            intervals = sorted(self._rows.get((param.chunk, param.local_name), []))
            if not intervals:
                problems.append(f"{param.describe()} was never written")
                continue
            covered = 0
            for start, stop in intervals:
                if start != covered:
                    what = "written twice" if start < covered else "never written"
                    problems.append(
                        f"{param.describe()}: rows {min(start, covered)}..{max(start, covered)} {what}"
                    )
                    break
                covered = stop
            else:
                if covered != rows:
                    problems.append(f"{param.describe()}: rows {covered}..{rows} never written")
        if problems:
            raise CoverageError(
                f"{len(problems)} parameter(s) not loaded exactly once (a bug in a mapping table): "
                + "; ".join(problems[:5])
            )
