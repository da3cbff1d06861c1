"""A raw NCCL communicator for the tests and the tensor-parallel benchmark: the library takes an
ncclComm_t it does not own, so the caller (here) makes one through ctypes, with the unique id
shared over an already initialised torch.distributed group. NCCL is the one PyTorch loaded."""
from __future__ import annotations

import ctypes
import glob
import os


def nccl_path() -> str | None:
    """The libnccl.so.2 of the nvidia-nccl wheel PyTorch uses, else None (the loader's default)."""
    try:
        import nvidia.nccl
        for d in nvidia.nccl.__path__:
            hits = glob.glob(os.path.join(d, "lib", "libnccl.so*"))
            if hits:
                return sorted(hits)[0]
    except ImportError:
        pass
    return None


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * 128)]  # NCCL_UNIQUE_ID_BYTES, passed by value


class Comm:
    """An ncclComm_t of the torch.distributed world on this process's current device; `ptr` is
    what hl_loss_plan_execute_nccl takes. Destroyed with destroy()."""

    def __init__(self):
        import torch.distributed as dist
        path = nccl_path()
        os.environ.setdefault("HL_NCCL_LIBRARY", path or "libnccl.so.2")
        self.lib = ctypes.CDLL(path or "libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                              ctypes.c_int]
        uid = UniqueId()
        if dist.get_rank() == 0:
            self._ok(self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        box = [bytes(uid) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        ctypes.memmove(ctypes.addressof(uid), box[0], ctypes.sizeof(uid))
        self.comm = ctypes.c_void_p()
        self._ok(self.lib.ncclCommInitRank(ctypes.byref(self.comm), dist.get_world_size(), uid,
                                           dist.get_rank()))
        self.ptr = self.comm.value

    def _ok(self, r: int) -> None:
        if r != 0:
            self.lib.ncclGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NCCL error {r}: {self.lib.ncclGetErrorString(r).decode()}")

    def destroy(self) -> None:
        if self.comm.value:
            self._ok(self.lib.ncclCommDestroy(self.comm))
            self.comm = ctypes.c_void_p()
