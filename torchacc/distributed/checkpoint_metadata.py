"""Reading a DCP checkpoint's ``.metadata`` without unpickling anything but DCP's metadata.

``torch.distributed.checkpoint.FileSystemReader`` loads ``.metadata`` with plain ``pickle``, so a
checkpoint from an untrusted source can run code when it is opened; ``SafeFileSystemReader`` is
the same reader whose metadata read builds only the classes listed here (the weights_only part
of Note [Sharded checkpoints] in checkpoint.py).
"""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

# Everything a DCP .metadata pickle names (Note [Sharded checkpoints] in checkpoint.py): its
# dataclasses, torch.Size, dtypes, layouts (by name) and the checkpoint id's path type. No
# function that acts on the world is reachable through them.
_DCP_MD = "torch.distributed.checkpoint.metadata"
_SAFE = {
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "StorageMeta"),
    (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names {module}.{name}, which is not one of DCP's metadata "
            "classes; refusing to unpickle it (weights_only)"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read builds only DCP's metadata classes."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
