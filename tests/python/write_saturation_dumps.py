#!/usr/bin/python3
"""Write, with the kvdump package (python/kvdump), one correctly saturated kvdump and three copies
whose captured pool after the prefill is wrong in a way a real server can get wrong.

Usage: write_saturation_dumps.py OUT_DIR

Why: `kvaudit check` compares each step's captured `kv_cache_after` with its own replay of the
kvdump v1 write rule, code = e4m3_rne_satfinite(fp32(new_kv) / fp32(kv_scale)). These dumps let
tests/python/test_python_writer.cpp check that a dump from the Python writer is held to that rule:
the correct one passes, each corrupted one fails naming step S000, layer L005 and the slot.

The dump (same in all four files): H = 2, Dc = 32, Dr = 8, page_size = 2, 8 pages (16 slots).
  Layers: L000 (kv_scale 1/128) and L005 (kv_scale 0.01). Both kv_scales are small, so the
  outliers pinned in every other new_kv row (quotients +1000 and -768) saturate to 0x7E / 0xFE:
  in S000 those are the rows of slots 11, 12 and 0. L000 also holds in every row a value whose
  quotient is exactly 464, the tie that rounds to 448 (even mantissa) without saturating.
  Before S000: request 0 holds 3 tokens (slots 6, 7, 10), none of them saturated.
  S000 prefill: request 0 extends by 2 tokens (slots 11, 2), request 1 prefills 3 (12, 13, 0).
  S001 decode:  request 0 writes slot 3, request 1 writes slot 1.
  Every step of every layer carries kv_cache_after, computed with kvdump.quantize_e4m3.
Files written in OUT_DIR:
  saturated.h5   the correct dump: must pass.
  bf16_spill.h5  S000/L005/kv_cache_after: slot 2 (request 0's position 4) was stored as bf16, so
                 the row's 2*D little-endian bf16 bytes start at slot 2: slot 2 holds the first
                 half and slot 3 (unused until S001) the second.
  bf16_high.h5   S000/L005/kv_cache_after: slot 2 holds only the high byte of each element's bf16.
  nan_at_448.h5  S000/L005/kv_cache_after: NaN codes 0x7F / 0xFF (by sign) wherever the
                 satfinite write gives 0x7E / 0xFE, as a cast that does not saturate leaves them.
                 In L005 no quotient lies in [440, 464], so these are exactly the elements whose
                 |quotient| exceeds 464.
The numbers above (S000, L005, slots 2, 3) are what the C++ test looks for; the script prints the
slots holding NaN codes in nan_at_448.h5, one line "nan_slots: 0 11 12". It exits non-zero if
the dump would not exercise saturation (no 0x7E / 0xFE code written in S000 of L005).
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import kvdump  # noqa: E402

HEADS, DC, DR, PAGE_SIZE, NUM_PAGES = 2, 32, 8, 2, 8
D = DC + DR
NUM_SLOTS = NUM_PAGES * PAGE_SIZE
SM_SCALE = 1.0 / np.sqrt(DC + DR)
KV_SCALES = {0: 1.0 / 128.0, 5: 0.01}  # layer id -> kv_scale
CORRUPT_LAYER = 5
BF16_SLOT = 2  # request 0's last token of S000; slot 3 after it is written only in S001

CACHED = [6, 7, 10]  # request 0's tokens before S000: pages 3 and 5
# (kind, [(request, new slots)]), slots in token order following each request's pages.
STEPS = [
    ("prefill", [(0, [11, 2]), (1, [12, 13, 0])]),  # request 0 opens page 1, request 1 pages 6, 0
    ("decode", [(0, [3]), (1, [1])]),
]


def bf16_values(x):
    """float32 values rounded to bf16 (what a server holds)."""
    return kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(np.asarray(x, np.float32)))


def new_kv_rows(rng, rows, layer):
    """bf16 new_kv [rows, D]; the even rows hold outliers that saturate at this layer's kv_scale."""
    values = bf16_values(rng.uniform(-2.0, 2.0, size=(rows, D)).astype(np.float32))
    scale = np.float32(KV_SCALES[layer])
    outliers = bf16_values(np.array([1000.0, -768.0], np.float32) * scale)
    values[0::2, 0] = outliers[0]  # quotient ~ +1000: 0x7E
    values[0::2, DC + 1] = outliers[1]  # ~ -768: 0xFE
    if layer == 0:
        values[:, 5] = np.float32(464.0) * scale  # exactly 3.625: the tie, rounds to 448
    return values


class Pages:
    """Page table: each request's pages in token order, and its token count."""

    def __init__(self):
        self.pages = {0: [3, 5]}  # CACHED's pages
        self.length = {0: len(CACHED), 1: 0}

    def add(self, request, slots):
        for slot in slots:
            position = self.length[request]
            if position % PAGE_SIZE == 0:
                self.pages.setdefault(request, []).append(slot // PAGE_SIZE)
            page = self.pages[request][position // PAGE_SIZE]
            assert page * PAGE_SIZE + position % PAGE_SIZE == slot, (request, slot)
            self.length[request] = position + 1

    def indices(self, requests):
        """qo_indptr, kv_indptr, kv_indices, kv_last_page_len for (request, new slots) pairs."""
        qo, kv, pages, last = [0], [0], [], []
        for request, slots in requests:
            qo.append(qo[-1] + len(slots))
            pages += self.pages.get(request, [])
            kv.append(len(pages))
            length = self.length[request]
            last.append((length - 1) % PAGE_SIZE + 1 if length else 0)
        return qo, kv, pages, last


def main(out_dir):
    rng = np.random.default_rng(464)
    pools = {}
    for layer, scale in KV_SCALES.items():
        pool = np.zeros((NUM_SLOTS, D), np.uint8)
        pool[CACHED] = kvdump.quantize_e4m3(bf16_values(rng.uniform(-1, 1, (len(CACHED), D))
                                                        .astype(np.float32)), scale)
        pools[layer] = pool
    initial = {layer: pool.copy() for layer, pool in pools.items()}

    # Replay the steps once, recording every tensor and the pool after each step.
    table = Pages()
    steps = []
    for kind, requests in STEPS:
        for request, slots in requests:
            table.add(request, slots)
        slots = [slot for _, request_slots in requests for slot in request_slots]
        layers = {}
        for layer, scale in KV_SCALES.items():
            new_kv = new_kv_rows(rng, len(slots), layer)
            pools[layer][slots] = kvdump.quantize_e4m3(new_kv, scale)
            layers[layer] = dict(
                q_nope=bf16_values(rng.standard_normal((len(slots), HEADS, DC)).astype(np.float32)),
                q_pe=bf16_values(rng.standard_normal((len(slots), HEADS, DR)).astype(np.float32)),
                new_kv=new_kv, after=pools[layer].copy())
        steps.append((kind, table.indices(requests), slots, layers))

    # The prefill's L005: the rows, their quotients and the pool the server should have left.
    _, _, s0_slots, s0_layers = steps[0]
    s0 = s0_layers[CORRUPT_LAYER]
    scale = np.float32(KV_SCALES[CORRUPT_LAYER])
    quotient = np.abs(s0["new_kv"] / scale)
    written = s0["after"][s0_slots]
    saturated = (written & 0x7F) == 0x7E
    if not (np.any(written == 0x7E) and np.any(written == 0xFE)):
        sys.exit("write_saturation_dumps.py: S000/L005 writes no +448 and -448 code")
    if np.any((quotient >= 440) & (quotient <= 464)):
        sys.exit("write_saturation_dumps.py: an L005 quotient in [440, 464] rounds to 448 "
                 "without saturating; nan_at_448.h5 would not model a non-saturating cast")
    assert np.array_equal(saturated, quotient > 464)
    # The pool after S000 holds +-448 nowhere but in those rows, so nan_codes() below puts NaN
    # codes exactly where the satfinite write gives +-448.
    others = np.setdiff1d(np.arange(NUM_SLOTS), s0_slots)
    assert not np.any((s0["after"][others] & 0x7F) == 0x7E)

    def spill(after):
        row = kvdump.bf16_bits_from_float32(s0["new_kv"][s0_slots.index(BF16_SLOT)])
        raw = row.astype("<u2").tobytes()  # 2*D bytes, little-endian
        flat = after.reshape(-1)  # the pool's bytes in memory order
        start = BF16_SLOT * D
        flat[start:start + 2 * D] = np.frombuffer(raw, np.uint8)

    def high_bytes(after):
        row = kvdump.bf16_bits_from_float32(s0["new_kv"][s0_slots.index(BF16_SLOT)])
        after[BF16_SLOT] = (row >> 8).astype(np.uint8)

    def nan_codes(after):
        rows = after[s0_slots]
        after[s0_slots] = np.where((rows & 0x7F) == 0x7E, rows | 0x01, rows)

    nan_slots = sorted({s0_slots[i] for i in np.flatnonzero(saturated.any(axis=1))})
    variants = {"saturated.h5": None, "bf16_spill.h5": spill, "bf16_high.h5": high_bytes,
                "nan_at_448.h5": nan_codes}
    pool_shape = (NUM_PAGES, PAGE_SIZE, D)
    for name, corrupt in variants.items():
        path = os.path.join(out_dir, name)
        with kvdump.KvDumpWriter(path, model="saturation-check",
                                 producer="write_saturation_dumps.py", num_heads=HEADS,
                                 kv_lora_rank=DC, qk_rope_head_dim=DR, sm_scale=SM_SCALE,
                                 page_size=PAGE_SIZE) as dump:
            for layer, scale in KV_SCALES.items():
                dump.add_layer(layer, scale, initial[layer].reshape(pool_shape))
            for number, (kind, indices, slots, layers) in enumerate(steps):
                step = dump.add_step(kind, *indices, new_kv_slots=slots)
                for layer, tensors in layers.items():
                    after = tensors["after"].copy()
                    if corrupt is not None and number == 0 and layer == CORRUPT_LAYER:
                        corrupt(after)
                        assert not np.array_equal(after, tensors["after"])
                    step.add_layer(layer, tensors["q_nope"], tensors["q_pe"], tensors["new_kv"],
                                   kv_cache_after=after.reshape(pool_shape))
    print("nan_slots:", " ".join(str(slot) for slot in nan_slots))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    main(sys.argv[1])
