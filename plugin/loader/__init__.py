"""The rank-0 loader: one reader streams an HF checkpoint into Megatron-core models.

Modules, one concern each, in the order a load uses them:

- ``settings``: the ``rank0_loader`` settings section;
- ``checkpoint``: reading ``config.json``, safetensors headers and tensor bytes;
- ``mappings``: HF <-> Megatron name tables (``archs``: one module per architecture family);
- ``experts``: expert-parallel numbering (local <-> global expert index);
- ``transforms``: how HF tensors become a rank's parameter slice (QKV, gate/up, vocab);
- ``model``: reading this rank's Megatron model (parameters, config, shard) against a checkpoint;
- ``needs``: which tensors each of a rank's parameters needs, validated;
- ``plan``: every rank's demands, shared and packed into buckets;
- ``transport``: the loader's process groups, bucket headers and broadcasts, the read-ahead;
- ``route``: how buckets reach each rank: the nodes, their leaders, the channels between them;
- ``shm``: node-shared memory segments (the bucket slots of a node that receives);
- ``pagecache``: the reader's node copies from the page cache (the load's file mappings, the reader's progress);
- ``staging``: a rank's ring of page-locked chunks into CUDA, filled on its share of the cores;
- ``registration``: the page cache registered with CUDA, read-only, while the copies run;
- ``copier``: a rank's copies into its parameters, by the fastest of those routes that applies;
- ``stream``: the stream phase on one rank (read and send, or receive), applying buckets;
- ``progress``: the reader's progress bar;
- ``verify``: every parameter element written once (coverage);
- ``planning``: the planning phase across ranks (what each shares, the buckets, rank 0's lines);
- ``api``: ``load_hf_checkpoint``, the phases, each all-or-none across ranks.
"""
