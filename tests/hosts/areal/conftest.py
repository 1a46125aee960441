"""AReaL host tests: run in the ``areal`` nox session (AReaL 1.0.4 from PyPI, CPU)."""

import pytest

pytest.importorskip("areal", reason="AReaL tests run in the areal nox session")
