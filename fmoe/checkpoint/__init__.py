"""Checkpoints: save and load any plan to any plan, layout conversion, export."""

from .api import Checkpoint, load, read_config, read_lora, read_meta, save
from .convert import (
    convert_glu,
    export_state_dict,
    from_per_expert,
    import_state_dict,
    map_param_trees,
    to_per_expert,
)

__all__ = ["Checkpoint", "convert_glu", "export_state_dict", "from_per_expert", "import_state_dict", "load",
           "map_param_trees", "read_config", "read_lora", "read_meta", "save", "to_per_expert"]
