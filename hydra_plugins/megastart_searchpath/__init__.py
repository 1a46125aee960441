"""Makes megastart's config groups (``configs/overrides/``) available to every Hydra app.

Hydra 1.3 finds this module by scanning the ``hydra_plugins`` namespace package;
Hydra 1.4 through the ``hydra.plugins`` entry point. Hydra imports it in every
Hydra app at startup, so it imports nothing but Hydra.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONFIGS = "pkg://megastart.configs.overrides"


class MegastartSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="megastart", path=CONFIGS)
