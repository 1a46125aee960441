"""The rank-0 loader: one reader streams an HF checkpoint into Megatron-core models.

Three phases, a folder each, over the files; imports run one way, down this list
(``tests/core/test_import_graph.py`` checks it):

- ``api``: ``load_hf_checkpoint``, one function per phase, each all-or-none across ranks;
- ``stream/``: moving the bytes, bucket by bucket, into every rank's parameters;
- ``plan/``: every rank's demands made into buckets across ranks, and the coverage check;
- ``mapping/``: what a rank needs, and how HF tensors become its slices;
- ``checkpoint/``: reading ``config.json``, safetensors headers and tensor bytes;
- ``settings``: the ``rank0_loader`` settings section, which every phase reads.
"""
