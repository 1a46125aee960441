"""Rank 0's lines about the plan: tensors no parameter uses, parameters left to the host,
the readers of a striped load."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megastart.loader.mapping.mappings import VALUE_HEAD, MappingTable
from megastart.loader.settings import PLUGIN

if TYPE_CHECKING:
    from megastart.loader.plan.planning import Buckets

log = logging.getLogger("megastart")


def announce(
    buckets: Buckets,
    left_by_all: Sequence[str],
    checkpoint: str,
    table: MappingTable,
    *,
    striped: bool,
    value_model: bool,
) -> None:
    """Rank 0's lines about the plan: tensors not read, parameters left to the host, readers."""
    if buckets.unused:
        log.warning("megastart: %s", unused_message(list(buckets.unused), checkpoint, strict=False))
    heads = [n for n in left_by_all if value_model and n.startswith(VALUE_HEAD)]
    if heads:
        log.info(
            "megastart: value head %s keeps the host's initialisation: %r has no tensor of "
            "its shape for it (a weight is looked for in %s; a bias never is)",
            heads,
            checkpoint,
            ", ".join(table.value_head_sources),
        )
    if len(heads) < len(left_by_all):  # only the bridge's table leaves others
        log.info(
            "megastart: %s keep the host's initialisation: the host's Megatron-Bridge does not "
            "load them either (adapters, parameters none of its mappings names, an output "
            "layer tied to the embedding)",
            [n for n in left_by_all if n not in heads],
        )
    if striped:
        log.info(
            "megastart: %s striped over %d readers (%s), %.2f GB in %d buckets",
            PLUGIN,
            len(buckets.readers),
            _ranks_text(buckets.readers),
            buckets.plan.nbytes / 1e9,
            len(buckets.plan.buckets),
        )


def _ranks_text(ranks: Sequence[int]) -> str:
    """``ranks`` for a log line: all of a few, the first and last of many."""
    shown = ", ".join(map(str, ranks[:4]))
    return f"ranks {shown}" + (f", ... {ranks[-1]}" if len(ranks) > 4 else "")


def unused_message(unused: list[str], checkpoint: str, *, strict: bool) -> str:
    shown = ", ".join(repr(n) for n in unused[:5]) + (
        f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
    )
    if strict:
        return (
            f"checkpoint {checkpoint!r} holds {len(unused)} tensor(s) no Megatron parameter uses: {shown}; "
            "the model built is missing layers the checkpoint has, or set rank0_loader.strict=false"
        )
    return f"rank0_loader: {len(unused)} tensor(s) of {checkpoint!r} feed no parameter and were not read: {shown}"
