"""Example: write a small, self-consistent kvdump v1 file with the kvdump package.

    python3 python/examples/write_synthetic_dump.py dump.h5
    kvaudit info dump.h5

Any Python 3.10+ with numpy and h5py runs it (`python3 -m pip install ./python` installs them
into the interpreter it is run with); the kvdump package is taken from this checkout.

Two layers (ids 0 and 3), H = 4 heads, Dc = 64, Dr = 16, page_size = 4, an fp8 pool per layer with
its bf16 source; one request already holds 5 tokens. Steps: a prefill (request 0 extends by 2
tokens, request 1 prefills 3) and two decodes. It shows how to keep a page table and derive
kv_indptr / kv_indices / kv_last_page_len / new_kv_slots from it, and captures `out`, `lse` and
`kv_cache_after` from a float64 numpy attention over the dequantized pool, standing in for a
production kernel:
    s_t = sm_scale * (q_nope . c_t + q_pe . r_t),  lse = ln sum_t exp(s_t),
    out = sum_t exp(s_t - lse) c_t   over positions 0..p of the row's own token p.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvdump  # noqa: E402

HEADS, DC, DR, PAGE_SIZE, NUM_PAGES = 4, 64, 16, 4, 16
D = DC + DR
SM_SCALE = 1.0 / 16.0  # GLM-5: qk_head_dim^-0.5 = (192 + 64)^-0.5 (no YaRN mscale)
LAYERS = {0: 0.37, 3: 1.5}  # layer id -> kv_scale


class PageTable:
    """Pages of each request, allocated from a free list as tokens arrive."""

    def __init__(self, free_pages):
        self.free = list(free_pages)
        self.pages = {}
        self.length = {}

    def append(self, request, count):
        """Adds `count` tokens to `request`; returns their slots."""
        pages = self.pages.setdefault(request, [])
        start = self.length.get(request, 0)
        slots = []
        for pos in range(start, start + count):
            if pos // PAGE_SIZE == len(pages):
                pages.append(self.free.pop(0))
            slots.append(pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        self.length[request] = start + count
        return slots

    def step_indices(self, rows_per_request):
        """qo_indptr, kv_indptr, kv_indices, kv_last_page_len of the requests, in order."""
        qo, kv, indices, last = [0], [0], [], []
        for request, rows in rows_per_request:
            qo.append(qo[-1] + rows)
            indices += self.pages.get(request, [])
            kv.append(len(indices))
            length = self.length.get(request, 0)
            last.append(0 if length == 0 else (length - 1) % PAGE_SIZE + 1)
        return qo, kv, indices, last


def bf16(rng, *shape):
    """Random bf16 values as float32 (exactly representable)."""
    bits = kvdump.bf16_bits_from_float32(rng.standard_normal(shape).astype(np.float32))
    return kvdump.float32_from_bf16_bits(bits)


def attention(q_nope, q_pe, pool_values, visible_slots):
    """out [H, Dc] and lse [H] of one query row, in float64."""
    c = pool_values[visible_slots, :DC].astype(np.float64)
    r = pool_values[visible_slots, DC:].astype(np.float64)
    s = SM_SCALE * (q_nope.astype(np.float64) @ c.T + q_pe.astype(np.float64) @ r.T)  # [H, T]
    top = s.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(s - top).sum(axis=1))
    return np.exp(s - lse[:, None]) @ c, lse


def main(path):
    rng = np.random.default_rng(2024)
    table = PageTable(free_pages=[3, 7, 10, 1, 12, 5, 0, 2])
    num_slots = NUM_PAGES * PAGE_SIZE
    sources = {layer: np.zeros((num_slots, D), np.float32) for layer in LAYERS}
    pools = {layer: np.zeros((num_slots, D), np.uint8) for layer in LAYERS}
    cached = table.append(0, 5)  # request 0 was prefilled earlier
    for layer, scale in LAYERS.items():
        sources[layer][cached] = bf16(rng, len(cached), D)
        pools[layer][cached] = kvdump.quantize_e4m3(sources[layer][cached], scale)

    with kvdump.KvDumpWriter(path, model="synthetic-mla", producer="write_synthetic_dump.py",
                             num_heads=HEADS, kv_lora_rank=DC, qk_rope_head_dim=DR,
                             sm_scale=SM_SCALE, page_size=PAGE_SIZE) as dump:
        pool_shape = (NUM_PAGES, PAGE_SIZE, D)
        for layer, scale in LAYERS.items():
            dump.add_layer(layer, scale, pools[layer].reshape(pool_shape),
                           kv_source=sources[layer].reshape(pool_shape))
        for kind, rows in (("prefill", [(0, 2), (1, 3)]), ("decode", [(0, 1), (1, 1)]),
                           ("decode", [(0, 1), (1, 1)])):
            slots, positions, owners = [], [], []
            for request, count in rows:
                new = table.append(request, count)
                slots += new
                owners += [request] * count
                positions += range(table.length[request] - count, table.length[request])
            step = dump.add_step(kind, *table.step_indices(rows), new_kv_slots=slots)
            for layer, scale in LAYERS.items():
                q_nope = bf16(rng, len(slots), HEADS, DC)
                q_pe = bf16(rng, len(slots), HEADS, DR)
                new_kv = bf16(rng, len(slots), D)
                pools[layer][slots] = kvdump.quantize_e4m3(new_kv, scale)
                values = kvdump.decode_e4m3(pools[layer]) * np.float32(scale)
                out = np.zeros((len(slots), HEADS, DC), np.float32)
                lse = np.zeros((len(slots), HEADS), np.float32)
                for i, (request, pos) in enumerate(zip(owners, positions)):
                    visible = [table.pages[request][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
                               for p in range(pos + 1)]
                    row_out, row_lse = attention(q_nope[i], q_pe[i], values, visible)
                    out[i], lse[i] = row_out, row_lse
                # out is rounded float64 -> float32 -> bf16 (by the writer); the double rounding
                # can differ from one rounding in rare ties, far inside any kernel tolerance.
                step.add_layer(layer, q_nope, q_pe, new_kv, out=out, lse=lse,
                               kv_cache_after=pools[layer].reshape(pool_shape))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT.h5")
    main(sys.argv[1])
