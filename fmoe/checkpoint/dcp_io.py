"""torch.distributed.checkpoint plumbing: planners over boxes, JSON metadata.

The planners are DCP's public extension points: the save planner writes this rank's
boxes (DCP removes the duplicates replicated ranks send and builds the global
metadata), the load planner asks for the target boxes and DCP computes the
overlapping reads. DCP records its metadata as a pickle; fmoe stores the same facts
as JSON and loads through a reader that never unpickles anything (tensor bytes
are read with ``weights_only=True`` by DCP itself).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class BoxedTensor:
    """A global tensor of which this rank holds ``boxes``: ``[(offsets, view)]``."""

    def __init__(self, size, dtype, boxes):
        self.size, self.dtype, self.boxes = torch.Size(size), dtype, list(boxes)

    def box_at(self, offsets) -> torch.Tensor:
        offsets = tuple(offsets)
        return next(view for o, view in self.boxes if tuple(o) == offsets)


class BoxSavePlanner(DefaultSavePlanner):
    """Writes every box of ``tensors`` (``{fqn: BoxedTensor}``)."""

    def __init__(self, tensors: dict):
        super().__init__(flatten_state_dict=False)
        self.tensors = tensors

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, t in self.tensors.items():
            for offsets, view in t.boxes:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)
                data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=t.dtype), size=t.size)
                items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                                       tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.tensors[index.fqn].box_at(index.offset).contiguous()


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads into every box of ``tensors`` (``{fqn: BoxedTensor}``) in place."""

    def __init__(self, tensors: dict):
        super().__init__(flatten_state_dict=False)
        self.tensors = tensors

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, t in self.tensors.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in t.boxes]
            if chunks:
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.tensors[index.fqn].box_at(index.offset)


def metadata_to_json(md: Metadata) -> dict:
    """The facts a load needs from DCP's metadata, as JSON."""
    tensors = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise ValueError(f"checkpoint entry {fqn!r} is not a tensor")
        tensors[fqn] = {"dtype": str(m.properties.dtype).removeprefix("torch."), "size": list(m.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    storage = [{"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset), "index": i.index,
                "file": s.relative_path, "start": s.offset, "length": s.length,
                "transforms": None if s.transform_descriptors is None else list(s.transform_descriptors)}
               for i, s in md.storage_data.items()]
    return {"tensors": tensors, "storage": storage, "version": md.version}


def unwritten(js: dict) -> list[str]:
    """The pieces (``fqn at offsets``) that ``metadata_to_json``'s ``js`` plans but no
    file holds: what a writer thread that died left out (DCP's threads drop their
    errors and their results alike)."""
    held = {(e["fqn"], tuple(e["offset"] or ())) for e in js["storage"]}
    return [f"{fqn} at {offsets}" for fqn, t in js["tensors"].items() for offsets, _ in t["chunks"]
            if (fqn, tuple(offsets)) not in held]


def metadata_from_json(js: dict) -> Metadata:
    state = {}
    for fqn, t in js["tensors"].items():
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, t["dtype"])), torch.Size(t["size"]),
                                           chunks)
    storage = {MetadataIndex(e["fqn"], None if e["offset"] is None else torch.Size(e["offset"]), e["index"]):
               _StorageInfo(e["file"], e["start"], e["length"], e["transforms"]) for e in js["storage"]}
    return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta(),
                    version=js.get("version"))


class JsonMetadataReader(FileSystemReader):
    """FileSystemReader whose metadata comes from fmoe's JSON, never from a pickle."""

    def __init__(self, path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata
