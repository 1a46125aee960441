"""The communicator warmup: connect the groups a Megatron train step uses, early.

Modules: ``settings`` (the ``comm_warmup`` section), ``groups`` (which
``parallel_state`` groups, which operations, and why), ``ops`` (running them),
``api`` (``warmup_communicators``).
"""
