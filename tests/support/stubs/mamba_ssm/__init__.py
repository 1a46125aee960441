"""Test-only stand-in for ``mamba_ssm`` (a CUDA source build, on neither machine).

megatron-core's ``MambaMixer`` refuses to build without ``mamba_ssm`` and takes its gated
RMSNorm from it. This stub gives the mixer what *building* and *loading* need: the norm's
parameter (a ``weight`` of the local inner size, as ``mamba_ssm``'s ``RMSNorm`` holds it) and
the scan kernels' names, which raise if a forward calls them. It is on ``sys.path`` only
where ``tests/support/te_stub.py`` puts its stubs (the Megatron-Bridge tests), never installed.
"""

__version__ = "0.0.0"
