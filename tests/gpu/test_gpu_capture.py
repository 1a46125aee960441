"""No hook and no warmup inside a CUDA graph capture (issue #38): the check the library
adapters and the warmup share sees a capture while one is under way, and only then."""

from __future__ import annotations

import pytest
import torch

from megastart.distributed.world import capturing_cuda_graph

pytestmark = pytest.mark.gpu


def test_capture_is_seen_while_a_graph_is_captured_and_only_then() -> None:
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    seen_before = capturing_cuda_graph()
    with torch.cuda.graph(graph):
        seen_during = capturing_cuda_graph()
        x.add_(1)
    seen_after = capturing_cuda_graph()
    graph.replay()
    torch.cuda.synchronize()
    assert (seen_before, seen_during, seen_after) == (False, True, False)
    assert x.tolist() == [1.0, 1.0, 1.0, 1.0]  # the captured work ran on replay
