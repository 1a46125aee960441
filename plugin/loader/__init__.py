"""The rank-0 loader: one reader streams an HF checkpoint into Megatron-core models.

Modules, one concern each: ``settings`` (the ``rank0_loader`` section),
``checkpoint`` (reading safetensors headers and tensors), ``mappings`` (HF <->
Megatron name tables), ``plan`` (who needs which tensor, how transformed),
``transport`` (the loader's own process group and bucket broadcast),
``verify`` (coverage), ``api`` (``load_hf_checkpoint``).
"""
