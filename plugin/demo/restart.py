"""A Megatron distributed checkpoint of the model, saved and restored on CPU.

This is the recover checkpoint a host writes while training and reads back on
a restart: ``megatron.core.dist_checkpointing`` (``torch_dist`` format, each
rank writes and reads only its own shards), keyed ``model0``, ``model1``, ...
per virtual pipeline chunk as Megatron-LM names them. It holds the model only;
the demo's optimizer starts fresh after the restart.

CPU stand-ins (demo only): Megatron's ``torch_dist`` writer forks writer
processes and collects their results through a ``multiprocessing.Manager``
queue; inside a daemonic :class:`megastart.harness.launch.RankPool` worker neither may
start. :func:`_writer_processes_allowed` lets the (short-lived, joined) writer
forks start and hands the writer an in-process queue instead of a Manager,
which would leave a server process behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING

from megastart.demo.train import cuda_factories_on_cpu

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def save_checkpoint(chunks: list[GPTModel], directory: str) -> None:
    """Write this rank's shards of ``chunks`` to ``directory``; collective over WORLD."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    with _writer_processes_allowed(), cuda_factories_on_cpu():
        dist_checkpointing.save(_sharded_state_dict(chunks), directory)


def restore_checkpoint(chunks: list[GPTModel], directory: str) -> None:
    """Read this rank's shards from ``directory`` into ``chunks`` (strict); collective over WORLD."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded_state_dict(chunks), directory)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"], strict=True)


def _sharded_state_dict(chunks: list[GPTModel]) -> dict[str, object]:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


@contextlib.contextmanager
def _writer_processes_allowed() -> Iterator[None]:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    process = multiprocessing.current_process()
    daemon = process.daemon
    process.daemon = False
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None
        process.daemon = daemon
