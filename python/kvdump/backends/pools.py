"""A layer's KV pool held by an adapter, kept equal to the pool file kvaudit reads after each step.

The pool is [num_slots, D] as stored: uint8 e4m3fn codes, or int16 holding bf16 bits (a bfloat16
pool). Two placements:

  HostPool    the pool file itself, mapped (np.memmap, MAP_SHARED): a write into the tensor is a
              write into the file, so the file is current the moment a step's writes are done.
  DevicePool  a copy on a GPU. A step changes only the slots it writes (write_rows), so after the
              step those rows alone are copied back into the mapped file; the rest of the file
              already holds them.

`reload()` re-reads the file (the step's pool_reloaded: kvaudit rewrote it).
"""

import numpy as np
import torch


class HostPool:
    def __init__(self, files, spec):
        self.files, self.spec = files, spec
        self.reload()

    def reload(self):
        self.mapped = self.files.map(self.spec, "pool")
        # bf16 bits are uint16 in the file; torch's bits view of bfloat16 is int16.
        array = self.mapped.view(np.int16) if self.mapped.dtype == np.uint16 else self.mapped
        self.tensor = torch.from_numpy(array)

    def write_rows(self, slots, rows):
        self.tensor[slots] = rows

    def sync(self):
        """Nothing to copy: the tensor is the file."""


class DevicePool:
    def __init__(self, files, spec, device):
        self.files, self.spec, self.device = files, spec, device
        self.reload()

    def reload(self):
        self.mapped = self.files.map(self.spec, "pool")
        array = self.mapped.view(np.int16) if self.mapped.dtype == np.uint16 else self.mapped
        self.tensor = torch.from_numpy(np.array(array)).to(self.device)
        self.written = []

    def write_rows(self, slots, rows):
        self.tensor[slots] = rows
        self.written.append(slots)

    def sync(self):
        if not self.written:
            return
        slots = torch.unique(torch.cat(self.written))
        rows = self.tensor[slots].cpu().numpy()
        self.mapped[slots.cpu().numpy()] = rows.view(self.mapped.dtype)
        self.written = []


def make_pool(files, spec, device):
    return HostPool(files, spec) if torch.device(device).type == "cpu" else DevicePool(
        files, spec, device)
