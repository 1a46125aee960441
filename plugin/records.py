"""The records hooks receive and return: small, typed and immutable.

Nothing here imports torch or a host framework; the annotations that name them
are strings, so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from megastart.settings import Settings


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineContext:
    """A host-agnostic view of one training rank's Megatron engine.

    An engine adapter builds one per hook call from the host's own objects, so
    hook implementations never touch verl's or AReaL's classes.
    """

    host: str
    """Which host built this context: ``"verl"``, ``"areal"``, ``"demo"``, ..."""

    host_version: str
    """The installed version of the host distribution."""

    model_chunks: Sequence[Any]
    """This rank's Megatron-core model chunks, one per virtual pipeline stage,
    unwrapped from DDP / Float16Module: ``GPTModel`` instances, or (where the host's
    Megatron-Bridge built them) a multimodal model holding its language model as
    ``language_model`` beside its towers (``vision_model``, ``visual``, ...). The load
    fills every parameter of each chunk that the mapping names, towers included."""

    parallel_state: ModuleType
    """The ``megatron.core.parallel_state`` module the host initialised."""

    device: torch.device | str
    """Where this rank's parameters live (``cuda:N`` in production, ``cpu`` in tests)."""

    dtype: torch.dtype | None = None
    """The parameters' dtype, when the host fixes one (``None``: as built)."""

    hf_config: Any = None
    """The ``transformers`` config of the model being trained, when known."""

    is_restart: bool = False
    """True when this process resumes from a recover checkpoint."""

    value_model: bool = False
    """True for a value model (a critic, a reward model): the last stage's ``output_layer``
    is a one-output value head, not the LM head. The head belongs to the host unless the
    checkpoint holds a reward head of its shape (see ``on_model_load``)."""

    settings: Settings | None = None
    """The resolved megastart settings (``None``: resolve from the environment)."""

    host_dequantises: frozenset[str] = frozenset()
    """The quantisations (``quantization_config.quant_method``: ``"fp8"``, ...) whose
    checkpoints the host's own loader, on the path ``on_model_load`` replaces, dequantises.
    A quantised checkpoint a plugin cannot dequantise is left to the host for these, and
    refused for any other (never cast)."""

    hf_bridge: Any = None
    """The Megatron-Bridge bridge (``AutoBridge``) whose ``load_hf_weights`` the load
    replaces, where the host loads through one: its ``mapping_registry()`` then decides which
    checkpoint tensors fill which parameter (``None``: megastart's built-in tables decide)."""

    ddp_config: Any = None
    """Megatron's ``DistributedDataParallelConfig`` of these chunks, where the host wraps
    them in megatron-core's DDP (``None``: not known, or not wrapped yet): whether
    gradients are reduce-scattered (distributed optimizer) or all-reduced decides which
    communicators the first step makes."""

    extra: Mapping[str, Any] = field(default_factory=dict)
    """Host-specific details a plugin may use at its own risk (documented per adapter)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    """What an ``on_model_load`` implementation did; returning one means "handled"."""

    plugin: str
    """The plugin that loaded the weights."""

    checkpoint: str
    """The checkpoint directory it read."""

    bytes_read: int
    """Bytes read from checkpoint files by every reader of the job together."""

    bytes_broadcast: int
    """Bytes the reader(s) sent to other nodes (each bucket once per node that needs it;
    inside a node the ranks read the bytes from shared memory)."""

    seconds: float
    """Wall time of the whole load on this rank."""

    reader_ranks: tuple[int, ...]
    """Global ranks that read checkpoint files."""

    tensors: int = 0
    """Checkpoint tensors consumed."""

    left_to_host: tuple[str, ...] = ()
    """Megatron parameters (canonical names, every rank's together) the load did not touch
    and that keep the host's initialisation: a value head the checkpoint has no tensor for."""

    @property
    def throughput_gbps(self) -> float:
        """Checkpoint gigabytes (1e9 bytes) per second of wall time."""
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.plugin}: {self.tensors} tensors, {self.bytes_read / 1e9:.2f} GB read by "
            f"rank(s) {list(self.reader_ranks)}, {self.bytes_broadcast / 1e9:.2f} GB sent between nodes, "
            f"{self.seconds:.2f} s ({self.throughput_gbps:.2f} GB/s)"
            + (f"; left to the host: {list(self.left_to_host)}" if self.left_to_host else "")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupReport:
    """What the communicator warmup did on this rank."""

    trigger: str
    """The hook that ran it: ``"post_recover_load"`` or ``"pre_first_step"``."""

    groups: tuple[str, ...]
    """Names of the groups warmed, in the order warmed (``"tp"``, ``"pp"``, ...)."""

    operations: tuple[tuple[str, str], ...]
    """``(group name, operation)`` pairs performed, in order."""

    seconds: float
    """Wall time of the warmup on this rank."""

    gpu_free_before: int | None = None
    """Free GPU bytes before the warmup (``None`` off CUDA)."""

    gpu_free_after: int | None = None
    """Free GPU bytes after it; the difference is what NCCL allocated."""

    @property
    def nccl_bytes(self) -> int | None:
        """GPU memory the warmup's communicators took (``None`` off CUDA)."""
        if self.gpu_free_before is None or self.gpu_free_after is None:
            return None
        return self.gpu_free_before - self.gpu_free_after

    def summary(self) -> str:
        mem = "" if self.nccl_bytes is None else f", NCCL took {self.nccl_bytes / 2**20:.0f} MiB"
        return (
            f"comm_warmup ({self.trigger}): {len(self.groups)} groups "
            f"[{', '.join(self.groups)}], {len(self.operations)} operations, "
            f"{self.seconds:.2f} s{mem}"
        )
