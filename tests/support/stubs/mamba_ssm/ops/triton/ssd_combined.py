"""``mamba_ssm``'s scan kernels, by name only (see :mod:`mamba_ssm`)."""

from __future__ import annotations

from typing import Any


def mamba_chunk_scan_combined(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the mamba_ssm stub builds models; it does not run them")


def mamba_split_conv1d_scan_combined(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the mamba_ssm stub builds models; it does not run them")
