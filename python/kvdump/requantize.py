"""The same dump's FP8 pool at another per-tensor scale, rewritten from its unquantized rows.

    python -m kvdump.requantize IN OUT --kv-scale 1.0            # what a server serving 1.0 stores
    python -m kvdump.requantize IN OUT --kv-scale amax           # fp32(amax / 448) per layer
    python -m kvdump.requantize IN OUT --kv-scale calibrate:scales.json [--layers 0,2]

The math (docs/kvdump-v1.md, "The write rule"; S = num_pages * P slots, D = Dc + Dr):
    x      [S, D]   kv_source (bf16 bits or float32), the unquantized rows of the pool before
                    step 0; per step new_kv [Nq, D], the rows the step writes to new_kv_slots
    code   = e4m3_rne_satfinite(fp32(x) / fp32(s))     one binary32 division, one rounding
    s      = the new kv_scale of the layer: a float, or "amax": fp32(amax / 448) with
             amax = max |x| over the finite values of kv_source and of every step's new_kv (the
             rule kvdump.hf_capture writes its dumps with), or "calibrate:FILE": the k_scale
             `kvaudit calibrate --json FILE` recommends for the layer
The pool before step 0 (/layers/L###/kv_cache) becomes code(kv_source); each captured pool after
a step (/steps/S###/L###/kv_cache_after) becomes the pool before the step with that step's rows
written by the rule: the replay kvaudit's integrity check expects. Before rewriting, each of
them must be exactly that at the dump's own scale (a NaN code counts as equal where its source
value is NaN, and keeps its byte): a pool that is not its rows by the rule records something
(unused-slot garbage, a server's write fault) that no rule says how to carry to another scale,
so it is refused rather than silently replaced.

Written: a copy of IN with those datasets' values replaced and, per requantized layer, the new
kv_scale (float32) and the old one as `kv_scale_before_requantize`; the root attribute
`requantized_by` says how. Everything else is copied as it is: the v1.2 indexer cache, q, new_kv,
kv_source, topk_indices, other layers. IN.module.h5 (kvdump.hf_capture's side file), where it
exists, is copied to OUT.module.h5, where kvdump.hf_compare looks for it. Captured `out` / `lse`
were computed from the old pool; a dump that has them is refused unless --drop-captured-outputs
removes them from the requantized layers (and says which).

Refused (exit 2, one line naming the file, the object and what is wrong): OUT the same file as
IN, a layer without kv_source, a bfloat16 pool, per_token_group scales (scales computed per token
at write time: no per-tensor scale to change), a scale that is not finite and > 0 in float32.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np

from .codec import E4M3_MAX_FINITE, E4M3_NAN_CODE, float32_from_bf16_bits, quantize_e4m3
from .cli_args import layer_list


class RequantizeError(Exception):
    """Bad input: printed as one line, exit 2."""


# ---- the scale ----------------------------------------------------------------------------------

class ScaleSpec:
    """--kv-scale: a float, "amax", or "calibrate:FILE" (kvaudit calibrate --json)."""

    def __init__(self, text):
        self.text = text
        self.value = None
        self.calibration = None
        if text == "amax":
            return
        if text.startswith("calibrate:"):
            self.calibration = _calibrated_scales(text[len("calibrate:"):])
            return
        try:
            value = float(text)
        except ValueError:
            raise RequantizeError(f"--kv-scale: '{text}' is not a number, amax or "
                                  "calibrate:FILE") from None
        self.value = _usable_scale(value, f"--kv-scale {text}")

    def for_layer(self, layer_id, amax, where):
        """The float32 scale of one layer; amax: max |x| of its finite source values."""
        if self.value is not None:
            return self.value
        if self.calibration is not None:
            if layer_id not in self.calibration:
                raise RequantizeError(f"{where}: layer {layer_id} has no recommended k_scale in "
                                      f"{self.text[len('calibrate:'):]}")
            return _usable_scale(self.calibration[layer_id], f"{where}: calibrated k_scale")
        if not amax > 0:
            raise RequantizeError(f"{where}: kv_source and new_kv hold no finite nonzero value: "
                                  "amax gives no scale")
        # One binary32 division, as hf_capture writes it.
        return _usable_scale(np.float32(amax) / np.float32(E4M3_MAX_FINITE), f"{where}: amax/448")


def _usable_scale(value, who):
    scale = np.float32(value)
    if not (math.isfinite(scale) and scale > 0):
        raise RequantizeError(f"{who}: {value!r} is not finite and > 0 as a float32")
    return scale


def _calibrated_scales(path):
    """{layer_id: k_scale} from `kvaudit calibrate --json` (layers without one are left out)."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
        return {int(layer["layer_id"]): float(layer["k_scale"])
                for layer in document["layers"] if layer.get("k_scale") is not None}
    except OSError as error:
        raise RequantizeError(f"--kv-scale calibrate:{path}: {error.strerror}") from None
    except (ValueError, KeyError, TypeError) as error:
        raise RequantizeError(f"--kv-scale calibrate:{path}: not kvaudit calibrate --json "
                              f"output ({error!r})") from None


# ---- reading ------------------------------------------------------------------------------------

def _float_rows(dataset):
    """float32 values of a bf16 (u16 bits) or float32 dataset, as the write rule takes them."""
    data = dataset[...]
    if data.dtype == np.uint16:
        return float32_from_bf16_bits(data)
    return data.astype(np.float32)


def _is_nan_code(codes):
    return (codes & 0x7F) == E4M3_NAN_CODE


def _step_names(f):
    return sorted(f["steps"], key=lambda name: int(name[1:]))


def _check_dump(f, path):
    """Refuses what requantize does not rewrite: another pool kind than per-tensor e4m3."""
    kind = f.attrs.get("kv_scale_kind")
    kind = kind.decode() if isinstance(kind, bytes) else kind
    if kind is None:
        raise RequantizeError(f"{path}:/: no kv_scale_kind attribute: not a kvdump (kvaudit info "
                              "says what is wrong)")
    if kind != "per_tensor":
        raise RequantizeError(f"{path}:/: kv_scale_kind is {kind}: its scales are computed per "
                              "token at write time, there is no per-tensor scale to change "
                              "(requantize rewrites per_tensor pools)")
    dtype = f.attrs.get("kv_dtype")
    dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
    if dtype != "float8_e4m3fn":
        raise RequantizeError(f"{path}:/: kv_dtype is {dtype}: no FP8 pool to requantize")


def _layer_ids(f):
    return {int(f["layers"][name].attrs["layer_id"]): name for name in f["layers"]}


def _select_layers(f, path, wanted):
    layers = _layer_ids(f)
    if wanted is None:
        return [layers[layer] for layer in sorted(layers)]
    for layer in wanted:
        if layer not in layers:
            raise RequantizeError(f"{path}:/layers: no layer {layer} (the dump holds "
                                  f"{', '.join(str(k) for k in sorted(layers))})")
    return [layers[layer] for layer in wanted]


def _amax(f, layer, source):
    values = [source] + [_float_rows(f[f"steps/{step}/{layer}/new_kv"]) for step in _step_names(f)]
    finite = [np.abs(v[np.isfinite(v)]) for v in values]
    return max((float(v.max()) for v in finite if v.size), default=0.0)


# ---- the rewrite --------------------------------------------------------------------------------

def _first_difference(stored, expected, source, path, scale):
    """Refuses when `stored` is not `expected` (NaN codes equal where the source is NaN)."""
    differs = (stored != expected) & ~(_is_nan_code(stored) & np.isnan(source))
    if not differs.any():
        return
    at = tuple(int(i) for i in np.argwhere(differs)[0])
    raise RequantizeError(
        f"{path}[{at[0]}, {at[1]}, {at[2]}]: holds code 0x{int(stored[at]):02X} where the write "
        f"rule at the dump's kv_scale {float(scale):.9g} gives 0x{int(expected[at]):02X} "
        f"({int(differs.sum())} codes differ): the "
        "pool is not its rows by the rule, so no rule says what it would hold at another scale "
        "(kvaudit check judges it)")


def _keep_nan_bytes(new, stored, source):
    """The rule's codes, except that a NaN code stored for a NaN source value keeps its byte."""
    return np.where(_is_nan_code(stored) & np.isnan(source), stored, new).astype(np.uint8)


class _LayerPools:
    """One layer's pool at the dump's scale and at the new one, with the source value of every
    slot (kv_source, then each step's new_kv), kept as the steps write."""

    def __init__(self, source, old_scale, new_scale):
        self.source = source
        self.old_scale, self.new_scale = old_scale, new_scale
        self.old = quantize_e4m3(source, old_scale)
        self.new = quantize_e4m3(source, new_scale)

    def write(self, slots, rows, page_size):
        pages, offsets = slots // page_size, slots % page_size
        self.source[pages, offsets] = rows
        self.old[pages, offsets] = quantize_e4m3(rows, self.old_scale)
        self.new[pages, offsets] = quantize_e4m3(rows, self.new_scale)

    def rewrite(self, dataset, path):
        stored = dataset[...]
        _first_difference(stored, self.old, self.source, path, self.old_scale)
        dataset[...] = _keep_nan_bytes(self.new, stored, self.source)


def _requantize_layer(f, path, layer, spec, drop_captured):
    group = f[f"layers/{layer}"]
    where = f"{path}:/layers/{layer}"
    if "kv_source" not in group:
        raise RequantizeError(f"{where}: no kv_source: requantize writes the pool from the "
                              "unquantized rows")
    source = _float_rows(group["kv_source"])
    old_scale = np.float32(group.attrs["kv_scale"])
    new_scale = spec.for_layer(int(group.attrs["layer_id"]), _amax(f, layer, source), where)
    pools = _LayerPools(source, old_scale, new_scale)
    pools.rewrite(group["kv_cache"], f"{where}/kv_cache")
    page_size = int(f.attrs["page_size"])
    dropped = []
    for step in _step_names(f):
        tensors = f[f"steps/{step}/{layer}"]
        pools.write(f[f"steps/{step}/new_kv_slots"][...].astype(np.int64),
                    _float_rows(tensors["new_kv"]), page_size)
        if "kv_cache_after" in tensors:
            pools.rewrite(tensors["kv_cache_after"], f"{path}:/steps/{step}/{layer}/kv_cache_after")
        dropped += _captured_outputs(tensors, f"{path}:/steps/{step}/{layer}", drop_captured)
    group.attrs["kv_scale_before_requantize"] = old_scale
    group.attrs["kv_scale"] = new_scale
    return {"layer": layer, "kv_scale_before": float(old_scale), "kv_scale": float(new_scale),
            "dropped": dropped}


def _captured_outputs(tensors, where, drop):
    """out / lse of a requantized layer: computed from the old pool, so dropped when asked and
    refused otherwise. Returns the names dropped."""
    present = [name for name in ("out", "lse") if name in tensors]
    if present and not drop:
        raise RequantizeError(f"{where}/{present[0]}: captured from the pool at the dump's "
                              "kv_scale, which the requantized dump no longer holds; pass "
                              "--drop-captured-outputs to leave out and lse out")
    for name in present:
        del tensors[name]
    return [f"{where.split(':', 1)[1]}/{name}" for name in present]


def requantize(source_path, out_path, kv_scale, layers=None, drop_captured=False):
    """Writes OUT (and OUT.module.h5) as the module docstring says; returns, per requantized
    layer, {"layer", "kv_scale_before", "kv_scale", "dropped"}."""
    import h5py

    spec = kv_scale if isinstance(kv_scale, ScaleSpec) else ScaleSpec(str(kv_scale))
    _refuse_same_file(source_path, out_path)
    temp = _copy_to_temp(source_path, out_path)
    try:
        with h5py.File(temp, "r+") as f:
            _check_dump(f, source_path)
            summary = [_requantize_layer(f, source_path, layer, spec, drop_captured)
                       for layer in _select_layers(f, source_path, layers)]
            f.attrs["requantized_by"] = (f"kvdump.requantize --kv-scale {spec.text} from "
                                         f"{os.path.basename(source_path)}")
        _copy_side_file(source_path, out_path)
        os.replace(temp, out_path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return summary


def _refuse_same_file(source_path, out_path):
    if not os.path.isfile(source_path):
        raise RequantizeError(f"{source_path}: no such file")
    same = os.path.realpath(source_path) == os.path.realpath(out_path)
    if same or (os.path.exists(out_path) and os.path.samefile(source_path, out_path)):
        raise RequantizeError(f"{out_path}: OUT is IN; requantize writes a new dump beside it")


def _copy_to_temp(source_path, out_path):
    folder = os.path.dirname(os.path.abspath(out_path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(out_path)}.requantize-", dir=folder)
    os.close(fd)
    shutil.copyfile(source_path, temp)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(temp, 0o666 & ~mask)  # a plain file's permissions, not mkstemp's 0600
    return temp


def _copy_side_file(source_path, out_path):
    side = source_path + ".module.h5"
    if os.path.exists(side):
        shutil.copyfile(side, out_path + ".module.h5.tmp")
        os.replace(out_path + ".module.h5.tmp", out_path + ".module.h5")


# ---- command line -------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kvdump.requantize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Exit 0 written, 2 bad input.")
    parser.add_argument("dump", metavar="IN", help="a kvdump with kv_source (per_tensor, e4m3)")
    parser.add_argument("out", metavar="OUT", help="the dump to write (not IN)")
    parser.add_argument("--kv-scale", required=True, metavar="FLOAT|amax|calibrate:FILE",
                        help="the new per-tensor scale: a float (1.0: a server's default), amax "
                             "(fp32(amax/448) per layer), or calibrate:FILE (the k_scale kvaudit "
                             "calibrate --json FILE recommends per layer)")
    parser.add_argument("--layers", type=layer_list, default=None,
                        help="layer ids (comma list) to requantize; the others are copied as "
                             "they are (default: every layer)")
    parser.add_argument("--drop-captured-outputs", action="store_true",
                        help="leave out the captured out / lse of the requantized layers "
                             "(computed from the old pool); without it a dump holding them is "
                             "refused")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        summary = requantize(args.dump, args.out, args.kv_scale, args.layers,
                             args.drop_captured_outputs)
    except RequantizeError as error:
        print(f"requantize: {error}", file=sys.stderr)
        return 2
    except KeyError as error:  # h5py: an object the format requires is missing
        print(f"requantize: {args.dump}: a required object is missing ({error}); kvaudit info "
              f"{args.dump} says which", file=sys.stderr)
        return 2
    except OSError as error:  # its message names the file (IN, OUT or a temporary beside OUT)
        print(f"requantize: {error}", file=sys.stderr)
        return 2
    for layer in summary:
        print(f"requantize: {args.out}:/layers/{layer['layer']}: kv_scale "
              f"{layer['kv_scale_before']:.9g} -> {layer['kv_scale']:.9g}")
        for name in layer["dropped"]:
            print(f"requantize: {args.out}:{name}: left out (captured from the old pool)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
