"""The local world the shipped ``demo`` and ``bench`` commands (and the tests) run in: a pool
of ranks over gloo (:mod:`.launch`), the CPU shims Megatron-core needs there (:mod:`.cpu`),
tiny ``transformers`` checkpoints (:mod:`.checkpoints`) and Megatron models built from them
(:mod:`.model`). Not on any path ``import megastart`` or a host's workers take."""
