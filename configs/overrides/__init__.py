"""Config groups that megastart's Hydra ``SearchPathPlugin`` adds to every Hydra app.

Hydra reads them through ``pkg://megastart.configs.overrides``, which needs this
file: Hydra's package config source only accepts a directory holding an
``__init__.py``.
"""
