"""What every adapter of this package shares: torch, the device, the planted faults, one pool per
layer and the write of a step's new KV rows. A subclass supplies the attention (`attend`) and,
where it can, `bench`.

A step (docs/backend-protocol.md "step"), for Nq rows, H heads, Dc + Dr = D:
  1. new_kv [Nq, D] is written into slots new_kv_slots [Nq] of the layer's pool by the write rule
     (writes.py; `--write`, default PyTorch's own cast as servers do it). A per_token_group pool
     (protocol version 2: slots of model.slot_bytes bytes, grouped.py) is written by the kvdump
     v1.1 rule (kvdump.codec.quantize_rows, with hello's reciprocal_scale), whatever `--write` says:
     the server rules above are casts with one per-tensor scale;
  2. attend() returns out [Nq, H, Dc] bf16 and lse [Nq, H] float32 (natural log) on the device;
  3. the outputs go back as bf16 bits / float32, and the pool file is brought up to date.
"""

import sys
import time

import numpy as np

from .environment import cast_probe, describe_environment, import_torch, resolve_device
from . import grouped
from .faults import FAULTS, LOG2E, check_faults
from .protocol import Adapter, StepResult, unsupported

GROUPED_WRITE_RULE = ("kvdump v1.1 per_token_group rule (kvdump.codec.quantize_rows): per slot and "
                      "group scale = fp32(amax / 448) | 2^ceil(log2(amax / 448)) | its e8m0 code "
                      "(1 for an all-zero group), codes e4m3_rne_satfinite(x / scale); RoPE as "
                      "bf16 bits or e4m3_rne_satfinite(x / kv_scale); --write does not apply")

# Faults this package plants in every adapter (adapters may offer more).
COMMON_FAULTS = ("round-toward-zero", "lse-base2", "sm-scale-missing", "sm-scale-log2e")


class PooledAdapter(Adapter):
    name = "?"
    available_faults = tuple(FAULTS)
    default_device = None  # None: cuda when available, else cpu

    def __init__(self, options):
        self.options = options
        self.pools = {}
        self.torch = None
        self.warned = set()

    # -- hello ---------------------------------------------------------------------------------

    def start(self, model, files):
        self.torch = import_torch()
        self.import_libraries()
        from . import pools, writes  # they import torch

        self.pool_module, self.writes = pools, writes
        self.model, self.files = model, files
        self.conventions = check_faults(self.options.fault or [], self.available_faults,
                                        self.name)
        self.device = resolve_device(self.torch, self.options.device or self.default_device)
        if model.kv_dtype == "bfloat16" and self.conventions.round_toward_zero:
            raise unsupported("fault round-toward-zero needs an FP8 pool; this dump's kv_dtype is "
                              "bfloat16")
        if model.grouped and self.conventions.round_toward_zero:
            raise unsupported("fault round-toward-zero plants into the per-tensor write rules; "
                              "this dump's pool is per_token_group (written by the v1.1 rule)")
        self.check_model(model)
        self.prepare()
        return self.describe()

    def import_libraries(self):
        """Imports what the adapter needs beyond torch (unsupported, naming it, if missing)."""

    def check_model(self, model):
        """Raises unsupported for a dump this adapter cannot serve."""

    def prepare(self):
        """Builds what the adapter needs once (workspaces, wrappers)."""

    def describe(self):
        if self.model.grouped:
            write = GROUPED_WRITE_RULE
        elif self.model.kv_dtype != "bfloat16":
            write = self.writes.WRITE_RULES[self.options.write]
        else:
            write = "new_kv stored as bf16 (float32 rounded to nearest even)"
        if (self.options.write == "kvdump" or self.model.grouped) and self.model.reciprocal_scale:
            write += ", with the reciprocal scale (hello's reciprocal_scale)"
        describe = {"adapter": self.name, "name": self.model.name,
                    **describe_environment(self.torch, self.device, self.library()),
                    "options": self.option_summary(), "write_rule": write,
                    "math": self.math(),
                    "torch_fp8_cast": cast_probe(self.torch, self.device)}
        if self.model.grouped:
            describe["pool"] = self.pool_summary()
        if self.conventions.faults:
            describe["faults"] = self.conventions.describe()
        return describe

    def library(self):
        return None

    def pool_summary(self):
        """What a per_token_group pool's slots hold (protocol version 2)."""
        m = self.model
        return {"kv_scale_kind": m.kv_scale_kind, "kv_scale_group_size": m.kv_scale_group_size,
                "kv_scale_format": m.kv_scale_format, "kv_rope_dtype": m.kv_rope_dtype,
                "slot_bytes": m.slot_bytes, "protocol_version": m.version}

    def option_summary(self):
        return {"device": str(self.device), "write": self.options.write,
                "fault": list(self.conventions.faults)}

    def math(self):
        return ""

    def capabilities(self):
        return ["check"]

    # -- layers and steps ----------------------------------------------------------------------

    def load_layer(self, layer, pool_spec):
        self.pools[layer.group] = self.pool_module.make_pool(self.files, pool_spec, self.device)

    def tensor(self, array):
        """A device tensor of a step input: uint16 arrays are bf16 bits, others as they are."""
        torch = self.torch
        if array.dtype == np.uint16:
            return torch.from_numpy(array.view(np.int16)).to(self.device).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def grouped_rows(self, step):
        """uint8 [Nq, slot_bytes]: the step's new rows written by the v1.1 rule (numpy)."""
        return grouped.encode_rows(grouped.float32_rows(step.new_kv), self.model,
                                   step.layer.kv_scale, reciprocal=self.model.reciprocal_scale)

    def write(self, step, pool):
        if step.num_rows == 0:
            return
        slots = self.torch.from_numpy(step.new_kv_slots.astype(np.int64)).to(self.device)
        if self.model.grouped:
            pool.write_rows(slots, self.torch.from_numpy(self.grouped_rows(step)).to(self.device))
            return
        new_kv = self.tensor(step.new_kv)
        if self.model.kv_dtype == "bfloat16":
            rows = self.writes.bf16_bits(new_kv)
        else:
            rows = self.writes.fp8_codes(new_kv, step.layer.kv_scale, self.options.write,
                                         reciprocal=self.model.reciprocal_scale,
                                         round_toward_zero=self.conventions.round_toward_zero)
        pool.write_rows(slots, rows)

    # Adapters that attend to a sparse step's listed tokens (topk_indices) set this.
    supports_sparse = False

    def run_step(self, step):
        if step.topk_indices is not None and not self.supports_sparse:
            raise unsupported(f"{self.name}: step {step.where} is sparse (topk_indices, K = "
                              f"{step.topk_indices.shape[1]}); this adapter attends densely")
        pool = self.pools[step.layer.group]
        if step.pool_reloaded:
            pool.reload()
        started = time.perf_counter()
        self.write(step, pool)
        out, lse = self.attend(step, pool)
        if self.conventions.lse_base2 and not self.lse_fault_in_kernel():
            lse = lse * LOG2E
        out_bits = out.view(self.torch.int16).cpu().numpy().view(np.uint16)
        lse = lse.float().cpu().numpy()
        seconds = time.perf_counter() - started
        pool.sync()
        return StepResult(out_bits=out_bits, lse=lse, compute_seconds=seconds)

    def attend(self, step, pool):
        raise NotImplementedError

    def lse_fault_in_kernel(self):
        """True where the kernel itself plants lse-base2 (FlashInfer: return_lse_base_on_e)."""
        return False

    def warn_once(self, key, text):
        if key not in self.warned:
            self.warned.add(key)
            print(f"kvdump.backends {self.name}: {text}", file=sys.stderr, flush=True)

    def synchronize(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
