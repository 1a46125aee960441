"""Never random weights: after a skipped HF load, the resume must have restored every
parameter of the model.

While a resume load runs, every ``megatron.core.dist_checkpointing.load`` is watched
(:func:`capture_reads`): the keys it was asked for (the metadata of its sharded state
dict) that came back in its result are the keys it read. Every key of each model
chunk's own sharded state dict must be among them (:func:`unrestored`); the ranks agree
over the control plane (:func:`agree_restored`), and if any rank lacks one, every rank
raises :class:`IncompleteResume`'s message, which names the first parameters nothing
loaded and the setting that turns the skip off.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megastart.errors import CheckpointError
from megastart.restart.policy import SETTING, VARIABLE

NAMED = 5
"""How many parameters the error names (then how many more)."""


class IncompleteResume(CheckpointError):
    """A resume load that replaced a skipped HF load left parameters it did not restore."""


@dataclass(slots=True)
class Reads:
    """What the ``dist_checkpointing.load`` calls of one resume read."""

    keys: set[str] = field(default_factory=set)
    calls: int = 0


@contextmanager
def capture_reads() -> Iterator[Reads]:
    """Record what every ``dist_checkpointing.load`` read while the block runs (its callers
    look it up in the module at each call: megatron-core's, Megatron-LM's, verl's, AReaL's,
    ROLL's and Megatron-Bridge's checkpoint code)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    reads = Reads()
    original = serialization.load

    def load(sharded_state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        asked = list(_sharded_leaves(sharded_state_dict))  # before load rewrites it in place
        result = original(sharded_state_dict, *args, **kwargs)
        got = result[0] if isinstance(result, tuple) else result  # strict="return_*"
        reads.keys.update(key for path, key in asked if _tensor_at(got, path))
        reads.calls += 1
        return result

    owners = (dist_checkpointing, serialization)
    for owner in owners:
        owner.load = load  # type: ignore[attr-defined]
    try:
        yield reads
    finally:
        for owner in owners:
            owner.load = original  # type: ignore[attr-defined]


def model_keys(chunks: Sequence[Any]) -> dict[str, str]:
    """Every checkpoint key of the chunks' sharded state dicts -> the first parameter (its
    state-dict name) it holds; ``_extra_state`` objects (Transformer Engine's) are no weights."""
    keys: dict[str, str] = {}
    for i, chunk in enumerate(chunks):
        prefix = f"model{i}." if len(chunks) > 1 else ""
        for path, key in _sharded_leaves(chunk.sharded_state_dict()):
            name = ".".join(str(p) for p in path)
            if not name.endswith("_extra_state"):
                keys.setdefault(key, prefix + name)
    return keys


def unrestored(chunks: Sequence[Any], reads: Reads) -> list[str]:
    """The parameters (state-dict names) of the chunks whose keys the resume did not read."""
    return [name for key, name in model_keys(chunks).items() if key not in reads.keys]


def agree_restored(missing: Sequence[str], *, total: int, resume: str, timeout_s: float) -> None:
    """Collective: return on every rank if no rank has ``missing`` parameters, else raise on
    every rank the first such rank's :class:`IncompleteResume`, bounded by ``timeout_s``."""
    import torch.distributed as dist

    error = None
    if missing:
        named = ", ".join(missing[:NAMED]) + (
            f" and {len(missing) - NAMED} more" if len(missing) > NAMED else ""
        )
        error = IncompleteResume(
            f"the resume from {resume!r} restored {total - len(missing)} of this rank's {total} "
            f"parameters; nothing loaded {named}. The HF load was skipped, so they would keep "
            f"their random initialisation. Resume from a checkpoint of this model, or turn the "
            f"skip off: {VARIABLE}=0 ({SETTING}=false)"
        )
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    from megastart.distributed import all_or_none, discarding_control, kept_control

    with (
        discarding_control(),
        all_or_none(
            "megastart: checking that the resume restored every parameter",
            timeout_s=timeout_s,
            control=kept_control(timeout_s=timeout_s),
        ),
    ):
        if error is not None:
            raise error


def _sharded_leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """``(path, key)`` of every sharded tensor (or tensor factory) in a sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _sharded_leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _sharded_leaves(v, (*path, i))
    elif hasattr(tree, "key") and not isinstance(tree, ShardedObject):
        yield path, str(tree.key)


def _tensor_at(tree: Any, path: tuple[Any, ...]) -> bool:
    """Whether a loaded state dict holds a tensor at ``path``."""
    import torch

    for part in path:
        if isinstance(tree, dict) and part in tree:
            tree = tree[part]
        elif isinstance(tree, list) and isinstance(part, int) and part < len(tree):
            tree = tree[part]
        else:
            return False
    return isinstance(tree, torch.Tensor)
