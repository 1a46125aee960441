"""Names megatron-bridge references at import time (its LoRA modules; 0.5's
``gpt_provider`` inspects ``GroupedLinear``); none can be built."""

import torch


class _Unavailable(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} is a test stub: Transformer Engine is not installed"
        )


class Linear(_Unavailable):
    pass


class LayerNormLinear(_Unavailable):
    pass


class TransformerLayer(_Unavailable):
    pass


class _Ops:
    """``te.ops``: megatron-bridge annotates methods with ``te.ops.Sequential``."""

    class Sequential(_Unavailable):
        pass


ops = _Ops()


class GroupedLinear(_Unavailable):
    pass
