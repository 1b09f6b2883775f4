#!/usr/bin/python3
"""Write a small kvdump v1 file using only the format page (docs/kvdump-v1.md), h5py and numpy.

A second, independent writer: if kvaudit's C++ reader and this script disagree about the format,
tests/format/test_kvdump_reader.cpp ("a dump written by h5py from the format page") fails.

Usage: write_dump_from_spec.py OUT.h5

What it writes (the C++ test checks these facts):
  model "spec-check", H = 4, Dc = 16, Dr = 8, page_size = 1, num_pages = 16, fp8 pool.
  layers L000 (layer_id 0, kv_scale 1.0, with kv_source) and L061 (layer_id 61, kv_scale 0.25).
  Before step 0, request A holds 3 tokens in slots 0, 5, 2; request B holds none. Every other
  slot is padding holding the NaN code 0x7F (legal data).
  S000 prefill: A extends by 2 tokens (slots 3, 7), B starts with 3 (slots 11, 12, 13).
  S001 decode:  A's next token goes to slot 9, B's to slot 14.
  S000/L061: q_nope[0, 0, 0] = 1.0 and new_kv[0, 1] = -0.5 are pinned.
It also mixes the encodings the page allows: variable- and fixed-length strings, int64
attributes, float32 in place of bfloat16 (q_pe of L061), and captured out / lse /
kv_cache_after computed here in float64.
"""
import sys

import h5py
import numpy as np

H, DC, DR = 4, 16, 8
D = DC + DR
PAGE_SIZE = 1
NUM_PAGES = 16
SM_SCALE = 1.0 / np.sqrt(DC + DR)
LAYERS = [("L000", 0, np.float32(1.0), True), ("L061", 61, np.float32(0.25), False)]
NAN_CODE = 0x7F


# ---- element encodings (format page, "Element encodings") ----------------------------------

def e4m3_values():
    """Value of each of the 256 e4m3fn codes (bias 7, no inf, S.1111.111 = NaN)."""
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> 3) & 0xF
        mantissa = code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values[code] = np.nan
        elif exponent == 0:
            values[code] = sign * mantissa / 8.0 * 2.0 ** -6
        else:
            values[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return values


E4M3 = e4m3_values()
POSITIVE = E4M3[:0x7F]  # codes 0x00..0x7E, increasing, 0 .. 448


def e4m3_rne_satfinite(x):
    """Nearest e4m3fn code, ties to the even code, saturating to +-448; NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    codes = np.empty(x.shape, dtype=np.uint8)
    for index, value in np.ndenumerate(x):
        if np.isnan(value):
            codes[index] = NAN_CODE
            continue
        magnitude = min(abs(float(value)), 448.0)
        distance = np.abs(POSITIVE - magnitude)
        best = np.flatnonzero(distance == distance.min())
        code = int(best[0]) if len(best) == 1 else int([c for c in best if c % 2 == 0][0])
        codes[index] = code | (0x80 if np.signbit(value) else 0)
    return codes


def quantize(values, kv_scale):
    """The write rule: e4m3_rne_satfinite(fp32(value) / fp32(kv_scale))."""
    return e4m3_rne_satfinite(np.asarray(values, np.float32) / np.float32(kv_scale))


def bf16_bits(values):
    """Round float32 to bfloat16, nearest even, as raw u16 bits."""
    bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)



def put_bf16(group, name, values):
    group.create_dataset(name, data=bf16_bits(values))
    group[name].attrs["dtype"] = "bfloat16"


def put_fp8(group, name, codes):
    group.create_dataset(name, data=np.asarray(codes, np.uint8))
    group[name].attrs["dtype"] = "float8_e4m3fn"


# ---- requests ---------------------------------------------------------------------------------

class Request:
    def __init__(self, slots):
        self.slots = list(slots)  # page ids in token order (page_size 1: a page is a slot)


def step_indices(requests, new_slots_per_request):
    """qo_indptr, kv_indptr, kv_indices, kv_last_page_len, new_kv_slots after appending."""
    qo, kv, indices, last, new_slots = [0], [0], [], [], []
    for request, new_slots_of_request in zip(requests, new_slots_per_request):
        request.slots.extend(new_slots_of_request)
        new_slots.extend(new_slots_of_request)
        qo.append(qo[-1] + len(new_slots_of_request))
        indices.extend(request.slots)
        kv.append(len(indices))
        last.append(1 if request.slots else 0)
    as_int32 = lambda v: np.asarray(v, dtype=np.int32)
    return [as_int32(v) for v in (qo, kv, indices, last, new_slots)]


def attention(q_nope, q_pe, pool_values, visible):
    """out [H, Dc] and lse [H] for one row over the visible slots, in float64."""
    rows = pool_values[visible]  # [T, D]
    scores = SM_SCALE * (rows[:, :DC] @ q_nope.T + rows[:, DC:] @ q_pe.T)  # [T, H]
    top = scores.max(axis=0)
    weights = np.exp(scores - top)
    lse = top + np.log(weights.sum(axis=0))
    out = (np.exp(scores - lse).T @ rows[:, :DC])
    return out, lse


def main(path):
    rng = np.random.default_rng(20240601)

    def draw(*shape):
        # Multiples of 1/16 in [-2, 2): exact in bf16.
        return rng.integers(-32, 32, size=shape).astype(np.float32) / 16.0

    with h5py.File(path, "w") as f:
        f.attrs["format"] = "kvdump"
        f.attrs["format_version"] = 1
        f.attrs["model"] = "spec-check"
        f.attrs["producer"] = np.bytes_(b"write_dump_from_spec.py")  # fixed-length string
        f.attrs["num_heads"] = H
        f.attrs["kv_lora_rank"] = DC
        f.attrs["qk_rope_head_dim"] = DR
        f.attrs["sm_scale"] = np.float64(SM_SCALE)
        f.attrs["page_size"] = PAGE_SIZE
        f.attrs["kv_dtype"] = "float8_e4m3fn"
        f.attrs["kv_scale_kind"] = "per_tensor"

        # Initial pools: A's three cached tokens, NaN-code padding elsewhere.
        cached_slots = [0, 5, 2]
        pools = {}
        for name, layer_id, kv_scale, has_source in LAYERS:
            source = np.zeros((NUM_PAGES * PAGE_SIZE, D), np.float32)
            codes = np.full((NUM_PAGES * PAGE_SIZE, D), NAN_CODE, np.uint8)
            for slot in cached_slots:
                source[slot] = draw(D)
                codes[slot] = quantize(source[slot], kv_scale)
            group = f.create_group("layers/" + name)
            group.attrs["layer_id"] = layer_id
            group.attrs["kv_scale"] = kv_scale
            put_fp8(group, "kv_cache", codes.reshape(NUM_PAGES, PAGE_SIZE, D))
            if has_source:
                put_bf16(group, "kv_source", source.reshape(NUM_PAGES, PAGE_SIZE, D))
            pools[name] = codes

        requests = [Request(cached_slots), Request([])]
        steps = [("prefill", [[3, 7], [11, 12, 13]]), ("decode", [[9], [14]])]
        for step_number, (kind, new_slots) in enumerate(steps):
            qo, kv, indices, last, slots = step_indices(requests, new_slots)
            group = f.create_group("steps/S%03d" % step_number)
            group.attrs["kind"] = kind
            for name, values in (("qo_indptr", qo), ("kv_indptr", kv), ("kv_indices", indices),
                                 ("kv_last_page_len", last), ("new_kv_slots", slots)):
                group.create_dataset(name, data=values)
            nq = len(slots)
            for name, layer_id, kv_scale, has_source in LAYERS:
                layer = group.create_group(name)
                q_nope, q_pe, new_kv = draw(nq, H, DC), draw(nq, H, DR), draw(nq, D)
                if step_number == 0 and name == "L061":
                    q_nope[0, 0, 0] = 1.0
                    new_kv[0, 1] = -0.5
                put_bf16(layer, "q_nope", q_nope)
                if name == "L061":
                    layer.create_dataset("q_pe", data=q_pe)  # float32 in place of bfloat16
                else:
                    put_bf16(layer, "q_pe", q_pe)
                put_bf16(layer, "new_kv", new_kv)
                # The step writes every row's token first, then attends.
                codes = pools[name]
                codes[slots] = quantize(new_kv, kv_scale)
                pool_values = E4M3[codes].astype(np.float64) * np.float64(kv_scale)
                out = np.zeros((nq, H, DC))
                lse = np.zeros((nq, H))
                for b in range(len(requests)):
                    kv_len = (kv[b + 1] - kv[b] - 1) * PAGE_SIZE + last[b] if kv[b + 1] > kv[b] else 0
                    n_q = qo[b + 1] - qo[b]
                    for j in range(n_q):
                        position = kv_len - n_q + j
                        visible = indices[kv[b]:kv[b] + position + 1]
                        row = qo[b] + j
                        out[row], lse[row] = attention(q_nope[row].astype(np.float64),
                                                       q_pe[row].astype(np.float64),
                                                       pool_values, visible)
                if kind == "prefill":
                    put_bf16(layer, "out", out.astype(np.float32))
                    layer.create_dataset("lse", data=lse.astype(np.float32))
                elif name == "L061":
                    put_fp8(layer, "kv_cache_after", codes.reshape(NUM_PAGES, PAGE_SIZE, D))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: write_dump_from_spec.py OUT.h5")
    main(sys.argv[1])
