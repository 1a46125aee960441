"""Importing this module activates megastart in this process.

It is megastart's entry in verl's plugin group ``verl.plugins``: verl >= 0.9
imports it at ``import verl`` (filtered by ``VERL_USE_EXTERNAL_PLUGINS``). A
script of any host may import it too. It only registers post-import hooks
(importing wrapt and :mod:`megastart.activation`); an adapter attaches when its
host module is imported.
"""

from megastart.activation import activate

activate()
