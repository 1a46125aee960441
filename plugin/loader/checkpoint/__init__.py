"""Reading an HF checkpoint directory: ``config.json``, safetensors headers, tensor bytes.

Only the reader rank reads the metadata. :func:`read_metadata` reads the config
and the headers (a few KiB per shard) and checks everything that can be checked
without reading the tensors: the index names existing regular files inside the
checkpoint directory, each header passes ``safetensors``' own validation, dtypes
are known, and the checkpoint is not quantised in a way the loader would cast
(:mod:`.quantised`). It records each shard's identity (:mod:`.files`), so every
later open of a shard, on any rank, is checked against the version the plan was
made from. :class:`TensorReader` then reads one tensor's bytes straight into a
caller's buffer, keeping a bounded number of shard files open.

The modules: :mod:`.entries` (the metadata record), :mod:`.meta` (config, index), :mod:`.headers`
(safetensors headers), :mod:`.pickles` (``.bin`` files), :mod:`.files` (regular
files, identities, bounded handles), :mod:`.quantised`, :mod:`.reader`.
"""

from megastart.loader.checkpoint.entries import ITEMSIZE, CheckpointMeta, TensorEntry
from megastart.loader.checkpoint.errors import CheckpointError
from megastart.loader.checkpoint.files import (
    ShardIdentity,
    as_seen_here,
    check_unchanged,
    open_shard,
)
from megastart.loader.checkpoint.meta import (
    BIN_INDEX,
    SAFETENSORS_INDEX,
    causal_lm_for_model_type,
    read_config,
    read_metadata,
    resolve_architectures,
)
from megastart.loader.checkpoint.quantised import (
    SCALE_SUFFIX,
    Quantisation,
    QuantisedCheckpoint,
    logical_shape,
)
from megastart.loader.checkpoint.reader import TensorReader, read_exact

__all__ = [
    "BIN_INDEX",
    "ITEMSIZE",
    "SAFETENSORS_INDEX",
    "SCALE_SUFFIX",
    "CheckpointError",
    "CheckpointMeta",
    "Quantisation",
    "QuantisedCheckpoint",
    "ShardIdentity",
    "TensorEntry",
    "TensorReader",
    "causal_lm_for_model_type",
    "as_seen_here",
    "check_unchanged",
    "logical_shape",
    "open_shard",
    "read_config",
    "read_exact",
    "read_metadata",
    "resolve_architectures",
]
