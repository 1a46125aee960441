"""Test-only stand-in for NVIDIA Transformer Engine, which has no CPU build.

megatron-bridge (imported by AReaL's Megatron engine and verl's default branch) runs
``import transformer_engine.pytorch as te`` at import time. This stub lets that
import succeed; it reports version 0.0.0, so megatron-core's version checks
(``is_te_min_version``) keep every Transformer Engine code path off. It is put
on ``sys.path`` by ``tests/support/te_stub.py`` only (the AReaL tests, verl's
Megatron-Bridge tests, ``tests/bridge``), never installed.
"""

__version__ = "0.0.0"
