"""Coverage: a parameter written zero times or twice anywhere is named, never passed."""

from __future__ import annotations

import pytest

from megastart.loader.mapping.needs import ParamInfo
from megastart.loader.plan.verify import Coverage, CoverageError

QKV = ParamInfo(0, "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.2.self_attention.linear_qkv.weight", (96, 64), "float32")  # fmt: skip
NORM = ParamInfo(
    1, "decoder.final_layernorm.weight", "decoder.final_layernorm.weight", (64,), "float32"
)


def test_rows_written_exactly_once_pass() -> None:
    coverage = Coverage()
    for start in (64, 0, 80):  # any order
        coverage.record(QKV, start, {0: 64, 64: 80, 80: 96}[start])
    coverage.record(NORM, 0, 64)
    coverage.check([QKV, NORM])


@pytest.mark.parametrize(
    ("pieces", "problem"),
    [
        ([], "was never written"),
        ([(0, 64), (80, 96)], "rows 64..80 never written"),
        ([(0, 64), (48, 96)], "rows 48..64 written twice"),
        ([(0, 64)], "rows 64..96 never written"),
    ],
)
def test_gaps_and_overlaps_are_named(pieces: list[tuple[int, int]], problem: str) -> None:
    coverage = Coverage()
    for start, stop in pieces:
        coverage.record(QKV, start, stop)
    coverage.record(NORM, 0, 64)
    with pytest.raises(CoverageError) as e:
        coverage.check([QKV, NORM])
    message = str(e.value)
    assert (
        "Megatron parameter 'decoder.layers.0.self_attention.linear_qkv.weight' (global name "
        "'decoder.layers.2.self_attention.linear_qkv.weight', shape [96, 64])" in message
    )
    assert problem in message
    assert "final_layernorm" not in str(e.value)
