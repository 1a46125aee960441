"""Restarts that skip the HF load they would overwrite.

On a restart verl, AReaL, ROLL and Megatron-Bridge scripts load the whole HF checkpoint
into the model and then their own checkpoint over it. Where a host adapter knows that a
resume follows, it defers the HF load (:meth:`Deferrals.defer`); what the host does in
between (an optimizer built from the parameters, an offload) must not run it. The
resume load that comes next replaces it (:meth:`Deferrals.resuming`): every rank checks
that the resume restored every key of its model's sharded state dict, and the ranks
agree (:mod:`.coverage`), else every rank fails naming what nothing loaded. Anything
else that needs the weights first (a forward or backward, a save, a weight sync, a copy
to another model) runs the deferred load before it (:meth:`Deferrals.run`).

One setting, ``rank0_loader.skip_hf_load_on_resume`` (on by default), turns it off
(:func:`skip_wanted`); what a skip saved is :func:`last_skipped`.

Nothing here imports torch or Megatron at import time.
"""

from megastart.restart.coverage import IncompleteResume, agree_restored, capture_reads, unrestored
from megastart.restart.deferral import DEFERRALS, Deferrals, Deferred
from megastart.restart.policy import checkpoint_bytes, skip_wanted
from megastart.restart.report import SkippedLoad, last_skipped

__all__ = [
    "DEFERRALS",
    "Deferrals",
    "Deferred",
    "IncompleteResume",
    "SkippedLoad",
    "agree_restored",
    "capture_reads",
    "checkpoint_bytes",
    "last_skipped",
    "unrestored",
    "skip_wanted",
]
