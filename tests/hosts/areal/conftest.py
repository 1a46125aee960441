"""AReaL host tests: run in the ``areal`` nox session (AReaL 1.0.4 from PyPI, CPU)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
for path in (HERE, TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)

pytest.importorskip("areal", reason="AReaL tests run in the areal nox session")
