"""``comm_warmup``: connect the train step's communicators early
(``post_recover_load`` and ``pre_first_step``, once per process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megastart import hookimpl
from megastart.warmup.settings import CommWarmupSettings

if TYPE_CHECKING:
    from megastart.records import EngineContext

megastart_settings = CommWarmupSettings


@hookimpl
def post_recover_load(engine: EngineContext, checkpoint: str) -> None:
    from megastart.warmup.api import warmup_for_engine

    warmup_for_engine(engine, trigger="post_recover_load")


@hookimpl
def pre_first_step(engine: EngineContext) -> None:
    from megastart.warmup.api import warmup_for_engine

    warmup_for_engine(engine, trigger="pre_first_step")
