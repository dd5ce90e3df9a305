"""FSDP as values: units, flat layouts, the lifecycle state machine, the step's shards."""

from .layout import FlatLayout, make_layout
from .lifecycle import Lifecycle, LifecycleError, Phase
from .spec import Domain, GroupDtype, GroupKey, Sharding, ShardSpec, shard_spec

__all__ = ["Domain", "FlatLayout", "GroupDtype", "GroupKey", "Lifecycle", "LifecycleError", "Phase", "ShardSpec",
           "Sharding", "make_layout", "shard_spec"]
