"""``load_hf_checkpoint``: the rank-0 loader's phases, run on every rank, each all-or-none.

1. metadata: rank 0 reads ``config.json`` and the safetensors headers, broadcasts them;
2. plan: every rank maps its parameters to HF tensors and checks shapes; the
   demands are all-gathered and every rank computes the same buckets;
3. stream: each reader broadcasts its group's buckets, every rank copies its
   shards into its parameters;
4. verify: every element of every local parameter was written exactly once.

A failure in any phase, on any rank, is raised on every rank (``all_or_none``),
within ``timeout_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from megastart.distributed import OwnGroups, all_or_none, broadcast_or_raise
from megastart.loader.checkpoint import CheckpointMeta, TensorReader, read_metadata
from megastart.loader.experts import check_expert_parallel, first_local_expert, global_expert_name
from megastart.loader.mappings import MappingTable, known_architectures, mapping_for
from megastart.loader.plan import (
    Need,
    ParamInfo,
    Plan,
    PlanError,
    build_plan,
    check_config,
    receiver_sets,
    resolve_needs,
    unused_tensors,
)
from megastart.loader.progress import Progress
from megastart.loader.settings import Rank0LoaderSettings
from megastart.loader.transforms import TRANSFORMS, Shard
from megastart.loader.transport import (
    IN_FLIGHT,
    Channel,
    Prefetcher,
    ReaderError,
    node_key,
    open_data_groups,
    open_receiver_groups,
    reader_groups,
    slot_view,
)
from megastart.loader.verify import Coverage
from megastart.records import LoadReport

if TYPE_CHECKING:
    import torch

    from megastart.records import EngineContext

log = logging.getLogger("megastart")

PLUGIN = "rank0_loader"


class UnsupportedArchitecture(PlanError):
    """No mapping table serves the checkpoint's architecture (the host's loader should run)."""


def load_for_engine(engine: EngineContext, checkpoint: str) -> LoadReport | None:
    """``on_model_load`` of the ``rank0_loader`` plugin: ``None`` (one warning) if no table fits."""
    if engine.settings is not None:
        settings = engine.settings.section(PLUGIN)
    else:
        from megastart.manager import get_settings

        settings = get_settings().section(PLUGIN)
    try:
        return load_hf_checkpoint(engine.model_chunks, checkpoint, settings=settings)
    except (
        UnsupportedArchitecture
    ) as e:  # decided on every rank from the same metadata, before any transfer
        if _rank() == 0:
            log.warning(
                "megastart: rank0_loader does not handle this checkpoint: %s; the host's loader runs",
                e,
            )
        return None


def load_hf_checkpoint(
    model_chunks: Sequence[Any], checkpoint_dir: str, *, settings: Rank0LoaderSettings | None = None
) -> LoadReport:
    """Load an HF checkpoint into this rank's Megatron-core model chunks, reading it once.

    Collective: every rank of the default process group calls it together. The
    parallel layout comes from ``megatron.core.parallel_state``.

    :param model_chunks: this rank's ``GPTModel`` chunks, one per virtual pipeline
        stage (unwrapped from DDP / Float16Module).
    :param checkpoint_dir: the directory with ``config.json`` and ``*.safetensors``.
    :param settings: the ``rank0_loader`` settings; by default the resolved ones.
    :returns: what was read and sent, and how long it took (same figures on every rank).
    :raises megastart.distributed.CollectiveError: on every rank, when any rank
        failed; the message names the first failing rank and its error.
    :raises UnsupportedArchitecture: on every rank, when no mapping table serves
        the checkpoint's ``architectures``.
    """
    settings = settings or _default_settings()
    start = time.perf_counter()
    with OwnGroups(timeout_s=settings.timeout_s) as own:
        return _load(list(model_chunks), str(checkpoint_dir), settings, own, start)


def _load(
    chunks: list[Any], checkpoint: str, settings: Rank0LoaderSettings, own: OwnGroups, start: float
) -> LoadReport:
    import torch.distributed as dist

    rank = dist.get_rank()
    control = own.new(None, backend="gloo")
    phase = partial(all_or_none, timeout_s=settings.timeout_s, control=control)

    meta: CheckpointMeta = broadcast_or_raise(
        f"{PLUGIN}: reading the metadata of {checkpoint!r}",
        partial(read_metadata, checkpoint, allow_pickle=settings.allow_pickle),
        src=0,
        timeout_s=settings.timeout_s,
        control=control,
    )
    table = _table(meta)

    with phase(f"{PLUGIN}: planning") as planned:
        params, tensors, shard, needs = local_needs(chunks, meta, table)
        device = tensors[next(iter(tensors))].device if tensors else _cpu()
        planned.share((node_key(), [(n.hf, n.param.dtype) for n in needs], device.type))
    gathered = planned.shared
    groups = reader_groups(settings.reader, [g[0] for g in gathered])
    group = next(g for g in groups if rank in g)

    with phase(f"{PLUGIN}: planning"):
        unused = unused_tensors([g[1] for g in gathered], meta, table)
        if unused and settings.strict:
            raise PlanError(_unused_message(unused, checkpoint, strict=True))
        plan = build_plan(
            [gathered[r][1] for r in group], meta, bucket_bytes=int(settings.bucket_mb * 2**20)
        )
        every_receiver_set = sorted(
            {
                tuple(members[i] for i in ranks)
                for members in groups
                for ranks in receiver_sets([gathered[r][1] for r in members])
                if len(ranks) < len(members)  # the whole reader group has its data group
            }
        )
        backend = _backend(settings.transport, {g[2] for g in gathered})
    if unused and rank == 0:
        log.warning("megastart: %s", _unused_message(unused, checkpoint, strict=False))

    # One gloo reader group can send over the control group: one group fewer to connect.
    single_gloo = backend == "gloo" and len(groups) == 1
    data_group = control if single_gloo else open_data_groups(groups, own, backend=backend)
    receivers = {tuple(group): data_group}
    receivers |= open_receiver_groups(every_receiver_set, own, backend=backend)
    coverage = Coverage()
    with phase(f"{PLUGIN}: streaming {checkpoint!r} and verifying the coverage") as loaded:
        channel = Channel(data_group, group[0], device if backend == "nccl" else _cpu(), receivers)
        stream = _Stream(plan, needs, tensors, shard, coverage, channel, group)
        read, sent = (
            stream.run_reader(meta, settings) if rank == group[0] else stream.run_receiver()
        )
        coverage.check(params)
        loaded.share((read, sent))
    totals = loaded.shared
    return LoadReport(
        plugin=PLUGIN,
        checkpoint=checkpoint,
        bytes_read=sum(r for r, _ in totals),
        bytes_broadcast=sum(s for _, s in totals),
        seconds=time.perf_counter() - start,
        reader_ranks=tuple(g[0] for g in groups),
        tensors=len({name for g in gathered for names, _ in g[1] for name in names}),
    )


def local_needs(
    chunks: list[Any], meta: CheckpointMeta, table: MappingTable | None = None
) -> tuple[list[ParamInfo], dict[tuple[int, str], torch.Tensor], Shard, list[Need]]:
    """What this rank needs from the checkpoint, checked against it: no collective.

    Returns this rank's parameters (canonical names), the tensors by ``(chunk,
    local name)``, its tensor-parallel shard, and one :class:`Need` per
    parameter: the HF tensors, the transform and the slice that fill it. Raises
    :class:`PlanError` (this rank only) when the checkpoint's config or shapes do
    not fit the model built. The benchmark's baselines use it too, so every
    strategy writes exactly what the loader writes.
    """
    table = table or _table(meta)
    params, tensors = _local_params(chunks)
    megatron = _megatron_config(chunks[0])
    check_expert_parallel(meta.config, megatron, checkpoint=meta.directory)
    check_config(table, meta.config, megatron, checkpoint=meta.directory)
    shard = _shard(megatron)
    return params, tensors, shard, resolve_needs(params, table, meta, shard)


class _Stream:
    """One rank's side of the stream: send (reader) or receive, then copy shards into parameters."""

    def __init__(
        self,
        plan: Plan,
        needs: list[Need],
        tensors: dict[tuple[int, str], torch.Tensor],
        shard: Shard,
        coverage: Coverage,
        channel: Channel,
        group: list[int],
    ) -> None:
        self.plan = plan
        self.tensors = tensors
        self.shard = shard
        self.coverage = coverage
        self.channel = channel
        self.ranks = [tuple(group[i] for i in bucket.ranks) for bucket in plan.buckets]
        """Global ranks each bucket is broadcast to (the reader first)."""
        self.consumers: dict[str, list[tuple[Need, int]]] = {}
        """HF tensor name -> this rank's needs that take it, and as which input."""
        for need in needs:
            for index, name in enumerate(need.hf):
                self.consumers.setdefault(name, []).append((need, index))

    def run_reader(self, meta: CheckpointMeta, settings: Rank0LoaderSettings) -> tuple[int, int]:
        """Read, broadcast and apply every bucket; returns (bytes read, bytes broadcast)."""
        import torch

        device = self.channel.device
        on_cuda = device.type == "cuda"
        reader = TensorReader(meta)
        # On CPU gloo sends from the host buffer itself, so each one in flight holds one;
        # on CUDA a host buffer is free once copied to its staging buffer on the GPU.
        prefetch = Prefetcher(
            reader,
            self.plan,
            buffers=2 if on_cuda else IN_FLIGHT + 1,
            pin=on_cuda,
            timeout_s=settings.timeout_s,
        )
        progress = Progress(self.plan.nbytes, enabled=settings.progress)
        staging = [
            torch.empty(
                self.plan.max_bucket_bytes if on_cuda else 0, dtype=torch.uint8, device=device
            )
            for _ in range(IN_FLIGHT)
        ]
        in_flight: deque[tuple[Any, Callable[[], None]]] = deque()
        sent = 0
        try:
            for index, bucket in enumerate(self.plan.buckets):
                try:
                    host = prefetch.next()
                except BaseException as e:
                    while in_flight:  # what was announced is delivered before the error
                        self._finish(*in_flight.popleft())
                    self.channel.send_error(
                        f"reader rank {_rank()} failed: {type(e).__name__}: {e}"
                    )
                    raise
                payload = host[: bucket.nbytes]
                if on_cuda:
                    payload = staging[index % IN_FLIGHT][: bucket.nbytes]
                    payload.copy_(host[: bucket.nbytes], non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record()  # the host buffer may be refilled once this has passed
                    prefetch.release(host, copied)
                    done = _nothing
                else:
                    done = partial(prefetch.release, host)
                in_flight.append((self.channel.send(payload, self.ranks[index]), done))
                sent += bucket.nbytes if len(self.ranks[index]) > 1 else 0
                self._apply(index, payload)
                progress.advance(bucket.nbytes)
                if len(in_flight) == IN_FLIGHT:
                    self._finish(*in_flight.popleft())
            while in_flight:
                self._finish(*in_flight.popleft())
            self._drain()
        finally:
            prefetch.close()
        return reader.bytes_read, sent

    def run_receiver(self) -> tuple[int, int]:
        """Receive this rank's buckets, ``IN_FLIGHT`` at a time, applying each once it has arrived."""
        import torch

        buffers = [
            torch.empty(self.plan.max_bucket_bytes, dtype=torch.uint8, device=self.channel.device)
            for _ in range(IN_FLIGHT)
        ]
        in_flight: deque[tuple[Any, Callable[[], None]]] = deque()
        received = 0
        try:
            for index, ranks in enumerate(self.ranks):
                started = self.channel.receive(buffers[received % IN_FLIGHT], ranks)
                if started is None:
                    continue
                payload, work = started
                received += 1
                in_flight.append((work, partial(self._apply, index, payload)))
                if len(in_flight) == IN_FLIGHT:
                    self._finish(*in_flight.popleft())
        except ReaderError:
            while in_flight:  # the reader sent these before its error: take them off the wire
                in_flight.popleft()[0].wait()
            raise
        while in_flight:
            self._finish(*in_flight.popleft())
        self._drain()
        return 0, 0

    @staticmethod
    def _finish(work: Any, then: Callable[[], None]) -> None:
        """Wait for one broadcast in flight (bounded by its group's timeout), then run ``then``."""
        if work is not None:
            work.wait()
        then()

    def _drain(self) -> None:
        """Wait for the queued copies and broadcasts: the loader's groups are destroyed next."""
        import torch

        if self.channel.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _apply(self, index: int, payload: torch.Tensor) -> None:
        import torch

        with torch.no_grad():
            for slot in self.plan.buckets[index].slots:
                for need, input_index in self.consumers.get(slot.name, ()):
                    param = self.tensors[(need.param.chunk, need.param.local_name)]
                    for first, stop, piece in TRANSFORMS[need.transform].blocks(
                        input_index,
                        slot_view(payload, slot),
                        slot.rows,
                        need.param.shape,
                        self.shard,
                    ):
                        param.data[first:stop].copy_(piece)
                        self.coverage.record(need.param, first, stop)


def _table(meta: CheckpointMeta) -> MappingTable:
    for arch in meta.architectures:
        table = mapping_for(arch)
        if table is not None:
            return table
    raise UnsupportedArchitecture(
        f"config.json of {meta.directory!r} names architectures {meta.architectures}, which no "
        f"mapping table serves (known: {known_architectures()}); register one through the "
        "entry-point group 'megastart.mappings'"
    )


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _local_params(chunks: list[Any]) -> tuple[list[ParamInfo], dict[tuple[int, str], torch.Tensor]]:
    """This rank's parameters with canonical names (global layer and expert numbers)."""
    params: list[ParamInfo] = []
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    for index, chunk in enumerate(chunks):
        decoder = getattr(chunk, "decoder", None)
        layers = getattr(decoder, "layers", [])
        global_layer = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(layers)}
        first_expert = first_local_expert(_megatron_config(chunk))
        for name, tensor in chunk.named_parameters():
            canonical = global_expert_name(_canonical(name, global_layer), first_expert)
            dtype = str(tensor.dtype).removeprefix("torch.")
            params.append(ParamInfo(index, name, canonical, tuple(tensor.shape), dtype))
            tensors[(index, name)] = tensor
    return params, tensors


def _canonical(name: str, global_layer: dict[str, str]) -> str:
    found = _LAYER.match(name)
    return (
        name if found is None else f"decoder.layers.{global_layer[found[1]]}.{name[found.end() :]}"
    )


def _megatron_config(chunk: Any) -> dict[str, Any]:
    config = chunk.config
    values = {f.name: getattr(config, f.name, None) for f in dataclasses.fields(config)}
    values["share_embeddings_and_output_weights"] = getattr(
        chunk, "share_embeddings_and_output_weights", None
    )
    return values


def _shard(megatron: dict[str, Any]) -> Shard:
    from megatron.core import parallel_state

    heads = megatron["num_attention_heads"]
    return Shard(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        num_heads=heads,
        num_query_groups=megatron.get("num_query_groups") or heads,
        head_dim=megatron.get("kv_channels") or megatron["hidden_size"] // heads,
        expert_tp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        expert_tp_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )


def _backend(transport: str, device_types: set[str]) -> str:
    if transport == "auto":
        return "nccl" if device_types == {"cuda"} else "gloo"
    if transport == "nccl" and device_types != {"cuda"}:
        raise PlanError(
            f"rank0_loader.transport=nccl needs CUDA parameters on every rank, found {sorted(device_types)}; "
            "use transport=auto or gloo"
        )
    return transport


def _unused_message(unused: list[str], checkpoint: str, *, strict: bool) -> str:
    shown = ", ".join(repr(n) for n in unused[:5]) + (
        f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
    )
    if strict:
        return (
            f"checkpoint {checkpoint!r} holds {len(unused)} tensor(s) no Megatron parameter uses: {shown}; "
            "the model built is missing layers the checkpoint has, or set rank0_loader.strict=false"
        )
    return f"rank0_loader: {len(unused)} tensor(s) of {checkpoint!r} feed no parameter and were not read: {shown}"


def _default_settings() -> Rank0LoaderSettings:
    from megastart.manager import get_settings

    return get_settings().sections.get(PLUGIN) or Rank0LoaderSettings()


def _nothing() -> None:
    pass


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
