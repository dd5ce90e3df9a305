"""FSDP as values: units, flat layouts, the lifecycle state machine, collectives, traces."""

from .comm import Group
from .layout import FlatLayout, make_layout
from .lifecycle import Lifecycle, LifecycleError, Phase
from .spec import ShardSpec, shard_spec
from .trace import Event, count, export_chrome_trace

__all__ = ["Event", "FlatLayout", "Group", "Lifecycle", "LifecycleError", "Phase", "ShardSpec", "count",
           "export_chrome_trace", "make_layout", "shard_spec"]
