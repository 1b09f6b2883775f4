"""`bench` requests: the adapter's kernel timed on data it generates for the case's shape.

Case data (GLM-5 / DeepSeek-V3 MLA widths, Dc = 512, Dr = 64, D = 576): B requests of `context`
tokens each, every request's ceil(context / P) pages drawn without repetition from a seeded
shuffle of the pool's pages (pool_slots, or just the pages needed); q_len rows per request (1 for
a decode, the last q_len tokens of the request for a prefill, causal). Values: ckv ~ N(0, 0.5^2),
kpe ~ N(0, 2^2) stored as e4m3fn codes at kv_scale 0.05, q ~ N(0, 0.05^2) in bf16 — ordinary
softmax, no NaN. The timing does not depend on the values, only on the shape.

Timing: `warmup` launches, then `iterations` samples, each with CUDA events recorded around the
launch alone on the current stream (host work before the first event is not timed). With a CUDA
graph (graph=True) the launch is one graph replay, so a launch made of many small kernels (the
torch adapter) is timed without the host gaps between them; where capture fails the eager launch
is timed and the method says so. flush_l2 overwrites a buffer of twice the GPU's L2 before each
sample, outside the events, so every sample reads its KV from HBM.
"""

import statistics
from dataclasses import dataclass

import numpy as np

from .paged_layout import requests_with_rows
from .protocol import unsupported

DC, DR = 512, 64
KV_SCALE = 0.05
SEED = 1


@dataclass
class CaseData:
    pool: object  # uint8 [slots, 576] e4m3fn codes on the device
    q_nope: object  # bf16 [Nq, H, 512]
    q_pe: object  # bf16 [Nq, H, 64]
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    kv_len: np.ndarray
    requests: list
    kv_scale: float = KV_SCALE


def case_indices(case):
    """The index arrays of the case (int32), as a server would hand them to the kernel."""
    pages_per_request = case.pages_per_request
    num_pages = -(-case.effective_pool_slots // case.page_size)
    rng = np.random.default_rng(SEED)
    pages = rng.permutation(num_pages)[:case.batch * pages_per_request].astype(np.int32)
    kv_indptr = (np.arange(case.batch + 1) * pages_per_request).astype(np.int32)
    last = case.context - (pages_per_request - 1) * case.page_size
    return dict(qo_indptr=(np.arange(case.batch + 1) * case.q_len).astype(np.int32),
                kv_indptr=kv_indptr, kv_indices=pages,
                kv_last_page_len=np.full(case.batch, last, dtype=np.int32),
                kv_len=np.full(case.batch, case.context, dtype=np.int32)), num_pages


def case_data(torch, case, device):
    if case.kv_dtype != "float8_e4m3fn":
        raise unsupported(f"bench case {case.name}: kv_dtype {case.kv_dtype} (only float8_e4m3fn "
                          "pools are timed)")
    indices, num_pages = case_indices(case)
    slots = num_pages * case.page_size
    generator = torch.Generator(device=device).manual_seed(SEED)
    pool = torch.empty((slots, DC + DR), dtype=torch.uint8, device=device)
    chunk = 1 << 16  # rows per chunk: bounds the float32 temporary to 144 MiB
    stddev = torch.tensor([0.5] * DC + [2.0] * DR, device=device) / KV_SCALE
    for start in range(0, slots, chunk):
        rows = min(chunk, slots - start)
        values = torch.randn((rows, DC + DR), generator=generator, device=device) * stddev
        pool[start:start + rows] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    nq = case.batch * case.q_len
    q_nope = (torch.randn((nq, case.num_heads, DC), generator=generator, device=device)
              * 0.05).to(torch.bfloat16)
    q_pe = (torch.randn((nq, case.num_heads, DR), generator=generator, device=device)
            * 0.05).to(torch.bfloat16)
    requests = requests_with_rows(indices["qo_indptr"], indices["kv_indptr"],
                                  indices["kv_indices"], indices["kv_last_page_len"],
                                  case.page_size)
    return CaseData(pool=pool, q_nope=q_nope, q_pe=q_pe, requests=requests, **indices)


def l2_flush_buffer(torch, device):
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or (64 << 20)
    return torch.empty(2 * l2, dtype=torch.uint8, device=device)


def capture_graph(torch, launch):
    """A CUDA graph of one launch, or None when capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture needs the launch warmed up off the default stream
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            launch()
    except RuntimeError:
        return None
    return graph


def time_on_gpu(torch, launch, case, graph=False, label=""):
    """{"median_us", "min_us", "samples", "method"} of `launch` (see the module docstring)."""
    for _ in range(case.warmup):
        launch()
    torch.cuda.synchronize()
    method = "cuda-events"
    replay = launch
    if graph:
        captured = capture_graph(torch, launch)
        if captured is not None:
            replay, method = captured.replay, "cuda-graph"
        else:
            method = "cuda-events (graph capture failed: eager launches, host gaps included)"
    flush = l2_flush_buffer(torch, torch.device("cuda")) if case.flush_l2 else None
    samples = []
    for _ in range(case.iterations):
        if flush is not None:
            flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)  # ms -> us
    if label:
        method += f", {label}"
    if flush is not None:
        method += ", L2 flushed"
    return {"median_us": statistics.median(samples), "min_us": min(samples),
            "samples": len(samples), "method": method}
