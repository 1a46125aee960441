"""``megastart bench warmup`` refuses, with the reason and the remedy, where NCCL cannot run it."""

from __future__ import annotations

import pytest

from megastart.cli import main


def test_bench_warmup_refuses_without_two_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs the benchmark needs")
    assert main(["bench", "warmup", "--tp", "2", "--json", "unused.json"]) == 2
    message = capsys.readouterr().err
    assert "needs at least 2 NVIDIA GPUs" in message
    assert "Run it on a machine with 2 or more GPUs" in message
