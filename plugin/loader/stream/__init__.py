"""Stream: moving the bytes of every bucket into the parameters that need them.

Takes the :class:`~megastart.loader.plan.buckets.Plan`, this rank's needs and its route
(reader, node leader or member); reads each bucket once, sends it once to each node
that needs it, and copies each rank's slices into its parameters (CPU, or CUDA through
page-locked chunks); returns the bytes read and sent, with every copy recorded in the
coverage that ``plan.verify`` checks.

Modules, in reading order:

- ``phase``: the phase across ranks (route, roles, coverage);
- ``stream``: the phase on one rank, what its roles share, applying buckets;
- ``sources``, ``straight``: where a bucket's slots are read from, which go straight to CUDA;
- ``roles``: which role a rank takes, and the takers' (copying their slices);
- ``readers``: the reading roles (the reader, striped readers);
- ``crossing``: buckets between nodes (broadcasts, a leader's relay);
- ``route``: how buckets reach each rank, between nodes and inside one;
- ``transport``: the loader's groups, bucket headers, broadcasts between nodes;
- ``prefetch``: the reader's read-ahead;
- ``node``, ``shm``: a node's page of the board, node-shared bucket memory;
- ``mappings``, ``pagecache``, ``frontier``, ``preads``: the reader's node takes its slices
  from the page cache (the load's file mappings, the reader's window over them, its progress,
  reads by ``pread``);
- ``copier``, ``staging``, ``registration``: a rank's copies into its parameters, into one
  GPU through page-locked chunks or registered mappings;
- ``progress``: the reader's progress bar.
"""
