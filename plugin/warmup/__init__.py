"""The communicator warmup: connect the groups a Megatron train step uses, early.

Modules: ``settings`` (the ``comm_warmup`` section), ``groups`` (which
``parallel_state`` groups, which operations, and why), ``ops`` (the steps, run
with bounded waits), ``p2p`` (pipeline and ring send/recv, paired without
deadlock), ``api`` (``warmup_communicators`` and the hooks' entry).
"""
