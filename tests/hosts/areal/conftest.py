"""AReaL host tests: run in the ``areal`` nox session (AReaL 1.0.4 from PyPI, CPU)."""

import pytest

pytest.importorskip("areal", reason="AReaL tests run in the areal nox session")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random Llama checkpoint of the harness's tiny size."""
    from megastart.harness.checkpoints import make_checkpoint

    return str(make_checkpoint("llama", tmp_path_factory.mktemp("hf")))
