"""Test-only stand-in for NVIDIA Transformer Engine, which has no CPU build.

megatron-bridge (imported by AReaL's Megatron engine) runs
``import transformer_engine.pytorch as te`` at import time. This stub lets that
import succeed; it reports version 0.0.0, so megatron-core's version checks
(``is_te_min_version``) keep every Transformer Engine code path off. It is put
on ``sys.path`` by ``tests/hosts/areal/areal_cpu.py`` only (for the AReaL tests
and verl's Megatron-Bridge tests), never installed.
"""

__version__ = "0.0.0"
