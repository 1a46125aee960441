"""``mamba_ssm``'s gated RMSNorm, its parameters only (see :mod:`mamba_ssm`)."""

from __future__ import annotations

from typing import Any

import torch


class RMSNorm(torch.nn.Module):
    """A ``weight`` of ``hidden_size`` (ones) and ``mamba_ssm``'s constructor arguments."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError("the mamba_ssm stub builds models; it does not run them")
