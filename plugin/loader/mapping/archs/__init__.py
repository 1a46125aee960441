"""The built-in mapping tables, one module per architecture family; the data types in
:mod:`.table`, what families share in :mod:`.decoder` and :mod:`.moe`."""

from megastart.loader.mapping.archs.deepseek import DEEPSEEK_V3, GLM4_MOE
from megastart.loader.mapping.archs.llama import LLAMA, MISTRAL
from megastart.loader.mapping.archs.mixtral import MIXTRAL
from megastart.loader.mapping.archs.qwen import QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE
from megastart.loader.mapping.archs.table import MappingTable

BUILTIN_TABLES: tuple[MappingTable, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    QWEN2_MOE,
    MIXTRAL,
    DEEPSEEK_V3,
    GLM4_MOE,
)

__all__ = ["BUILTIN_TABLES"]
