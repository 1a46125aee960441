"""The checkpoint's errors: raised on the reader while reading metadata, on any rank that opens a shard."""

from __future__ import annotations

from megastart.errors import CheckpointError

__all__ = ["CheckpointError", "QuantisedCheckpoint"]


class QuantisedCheckpoint(CheckpointError):
    """The checkpoint is quantised in a way the loader does not dequantise: reading it as it is
    stored would cast the weights without their scales."""

    def __init__(self, message: str, method: str) -> None:
        super().__init__(message)
        self.method = method
        """The quantisation: ``quantization_config.quant_method``, or what the tensors show."""

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # travels between ranks as it is
        return type(self), (str(self), self.method)
