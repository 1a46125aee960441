"""``rank0_loader``: load the HF checkpoint from one reader (``on_model_load``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megastart import hookimpl
from megastart.loader.settings import Rank0LoaderSettings

if TYPE_CHECKING:
    from megastart.records import EngineContext, LoadReport

megastart_settings = Rank0LoaderSettings


@hookimpl
def on_model_load(engine: EngineContext, checkpoint: str) -> LoadReport | None:
    from megastart.loader.api import load_for_engine

    return load_for_engine(engine, checkpoint)
