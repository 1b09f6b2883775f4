"""What the two Triton MLA decode adapters (vllm_triton_mla.py, sglang_triton_mla.py) share: the
peer file's loading, the refusals, the per-row batch (triton_layout.py) and the bench launch.

Model served: per-tensor FP8 pool uint8 [slots, 576] (512 latent + 64 RoPE e4m3 codes, one
kv_scale), page size P from the dump, H query heads sharing one latent KV head. Each step's rows
become Nq batch entries (triton_layout.py); out [Nq, H, 512] bf16 and lse [Nq, H] come back.
A Triton kernel runs on a CUDA GPU (SM89 or newer), or on the CPU under Triton's interpreter with
--triton-interpreter (or TRITON_INTERPRET=1 in the environment): triton_interpreter.py turns it
on, corrects its bf16 tl.dot and bf16 / fp8 roundings, and describe's kernel.triton_interpreter
says the kernel ran interpreted on the CPU (docs/peer-kernels.md "Without a GPU").
"""

import numpy as np

from . import triton_interpreter
from . import triton_layout as layout
from .peer_kernels import kernel_file, load, provenance
from .pooled_adapter import COMMON_FAULTS, PooledAdapter
from .protocol import unsupported

DC, DR = 512, 64
HEADS = (8, 16, 32, 64, 128)
INTERPRETER_SM_COUNT = 132  # an H200's, used for the split policy when no GPU is there


def interpreting():
    return triton_interpreter.interpreting()


class TritonMlaAdapter(PooledAdapter):
    available_faults = COMMON_FAULTS
    peer = None  # peer_kernels.PeerKernel
    interpreter = None  # triton_interpreter.summary() when the kernel runs interpreted

    @property
    def default_device(self):
        return "cpu" if self.wants_interpreter() else None

    def wants_interpreter(self):
        return getattr(self.options, "triton_interpreter", False) or interpreting()

    def import_libraries(self):
        if self.wants_interpreter():
            self.interpreter = triton_interpreter.enable(self.torch)
        self.kernel_path = kernel_file(self.peer, self.options.kernel_file)
        self.kernel = load(self.peer, self.kernel_path, self.torch)
        import triton

        self.triton_version = triton.__version__

    def check_model(self, model):
        if self.device.type != "cuda" and not self.interpreter:
            raise unsupported(f"{self.name}: a Triton kernel runs on a CUDA GPU (or on the CPU "
                              f"with --triton-interpreter); --device is {self.device}")
        if self.device.type == "cuda" and self.interpreter:
            raise unsupported(f"{self.name}: --triton-interpreter runs the kernel on the CPU; "
                              f"--device is {self.device}")
        if self.device.type == "cuda":
            major, minor = self.torch.cuda.get_device_capability(self.device)
            if (major, minor) < (8, 9):
                raise unsupported(f"{self.name}: Triton's float8e4nv needs SM89 or newer; this GPU "
                                  f"is SM{major}{minor}")
        if model.kv_dtype != "float8_e4m3fn" or model.grouped:
            raise unsupported(f"{self.name}: reads a per-tensor float8_e4m3fn pool of 576-byte "
                              f"slots; this dump is {model.kv_dtype}, {model.kv_scale_kind}")
        if (model.kv_lora_rank, model.qk_rope_head_dim) != (DC, DR):
            raise unsupported(f"{self.name}: the kernel's MLA tiles are 512 + 64 (Lk 576); this "
                              f"dump has {model.kv_lora_rank} + {model.qk_rope_head_dim}")
        if model.num_heads not in HEADS:
            raise unsupported(f"{self.name}: served for {HEADS} heads (head blocks of 16, more "
                              f"heads than one block fills); this dump has {model.num_heads}")

    def sm_count(self):
        if self.device.type == "cuda":
            return self.torch.cuda.get_device_properties(self.device).multi_processor_count
        return INTERPRETER_SM_COUNT

    def library_summary(self):
        return {**provenance(self.peer, self.kernel_path), "triton": self.triton_version,
                "triton_interpreter": self.interpreter or {"on": False},
                "sm_count": self.sm_count()}

    def describe(self):
        describe = super().describe()
        describe["kernel"] = self.library_summary()
        describe["tiles"] = self.tiles()
        tiles = self.diagnose_tiles()
        if tiles:
            describe["diagnose_tiles"] = tiles
        return describe

    def diagnose_tiles(self):
        """The KV tiles (TILExSPLITS, --diagnose-tile's syntax) over which the kernel rounds P to
        e4m3 against a running max, for kvaudit's p-e4m3-tile replay; None where it does not."""
        return None

    def option_summary(self):
        return {**super().option_summary(), "kernel_file": self.kernel_path,
                "num_kv_splits": self.options.num_kv_splits or "server policy"}

    def capabilities(self):
        return ["check", "bench"] if self.device.type == "cuda" else ["check"]

    # -- the batch -----------------------------------------------------------------------------

    def query(self, q_nope, q_pe):
        """q [Nq, H, 576] bf16 on the device (triton_layout.concat_q of the step's arrays)."""
        q = self.tensor(layout.concat_q(q_nope, q_pe))
        if q.dtype != self.torch.bfloat16:
            self.warn_once("q", "q is not bf16 bits in this dump; rounding it to bf16 (the "
                                "servers call these kernels with bf16 queries)")
            q = q.to(self.torch.bfloat16)
        return q.contiguous()

    def sm_scale(self):
        return self.conventions.softmax_scale(self.model.sm_scale)

    def attend(self, step, pool):
        torch = self.torch
        nq, heads = step.q_nope.shape[:2]
        if nq == 0:
            return (torch.zeros((0, heads, DC), dtype=torch.bfloat16, device=self.device),
                    torch.zeros((0, heads), dtype=torch.float32, device=self.device))
        entries = layout.row_entries(step.qo_indptr, step.kv_indptr, step.kv_indices,
                                     step.kv_last_page_len, self.model.page_size)
        q = self.query(step.q_nope, step.q_pe)
        return self.launch(q, pool.tensor, entries, step.kv_indptr, step.kv_indices,
                           self.model.page_size, step.layer.kv_scale, self.sm_scale())

    def launch(self, q, pool_tensor, entries, kv_indptr, kv_indices, page_size, kv_scale,
               sm_scale):
        """(out bf16 [Nq, H, 512], lse float32 [Nq, H]) on the device."""
        raise NotImplementedError

    def int_tensor(self, array, dtype):
        return self.torch.from_numpy(np.ascontiguousarray(array.astype(dtype))).to(self.device)

    # -- bench ---------------------------------------------------------------------------------

    def bench(self, case):
        from .bench import case_data, time_on_gpu

        torch = self.torch
        data = case_data(torch, case, self.device)
        entries = layout.row_entries(data.qo_indptr, data.kv_indptr, data.kv_indices,
                                     data.kv_last_page_len, case.page_size)
        q = torch.cat([data.q_nope, data.q_pe], dim=-1).contiguous()
        prepared = self.prepare_launch(q, data.pool, entries, data.kv_indptr, data.kv_indices,
                                       case.page_size, data.kv_scale, self.model.sm_scale)

        def launch():
            return self.run_prepared(prepared)

        return time_on_gpu(torch, launch, case,
                           label="stage 1 + stage 2 kernels, index arrays built outside")

    def prepare_launch(self, *args):
        raise NotImplementedError

    def run_prepared(self, prepared):
        raise NotImplementedError
