"""A module a user lists in VERL_USE_EXTERNAL_MODULES; the Ray test checks it is still imported."""
