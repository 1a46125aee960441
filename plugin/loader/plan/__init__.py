r"""Plan: every rank's demands, made into buckets across ranks.

Takes each rank's :class:`~megastart.loader.mapping.needs.Need`\ s and the checkpoint's
metadata; returns, on every rank, the :class:`~megastart.loader.plan.demands.Summary`
rank 0 sends (what the group asked for, the settings they agreed on) and the
:class:`~megastart.loader.plan.buckets.Plan` this rank streams by (the reader's whole
plan, or its node's view of it). After the stream, ``verify`` checks what the plan
promised: every element of every local parameter written once.

Modules, in reading order:

- ``buckets``: the plain-data core, demands in, buckets out (no torch.distributed);
- ``nodes``: a reader group's nodes and their leaders, which a bucket reaches;
- ``stripes``: ``reader=striped``, each node leader's share of the buckets;
- ``demands``: the mapping phase across ranks, what each rank shares and rank 0's summary;
- ``planning``: the planning phase, each reader group's buckets and each node's view;
- ``announce``: rank 0's lines about the plan;
- ``verify``: coverage, every parameter element written exactly once.
"""
