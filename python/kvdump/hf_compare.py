"""What kvaudit's references mean at the model's layer output, for a dump kvdump.hf_capture wrote:
kvaudit's latent outputs (`kvaudit check DUMP --save-outputs OUTPUTS`) mapped through the
module's W_UV (and o_proj, where the side file holds it), against the module's own outputs; with
--also, the same capture's pool at other scales (kvdump.requantize), one row per scale.

    python -m kvdump.hf_compare DUMP OUTPUTS [--also DUMP2 OUTPUTS2 ...] [--json FILE]

Per (step, layer), with A the module's attention output [Nq, H, Dv] (o_proj's input) and Y its
layer output [Nq, hidden] (DUMP.module.h5), Rs [Nq, H, Dc] exact attention on the unquantized
rows and R8 [Nq, H, Dc] exact attention on the FP8 pool at the dump's kv_scale s:
    source: W_UV Rs   vs A   (agreement, ~2^-24) and o_proj(W_UV Rs) vs Y
    fp8:    W_UV R8   vs A   (what FP8 storage at scale s costs after W_UV) and o_proj(W_UV R8)
                             vs Y (after o_proj: where the model sees it, when stored)
    fp8 latent: R8 vs Rs     (the same cost before W_UV: kvaudit check's quantization comparison)
Each as rel_l2 = ||x - ref||_2 / ||ref||_2 and max_abs / max|ref|. The source rows do not depend
on s (requantize keeps kv_source and new_kv), so they are printed once, from the first dump; every
fp8 row carries its layer's kv_scale. Every dump must be the same capture (equal module outputs).
"""

import argparse
import json
import os
import sys

import numpy as np


class CompareError(Exception):
    """Bad input: printed as one line, exit 2."""


def _errors(candidate, reference):
    norm = np.linalg.norm(reference)
    peak = np.abs(reference).max()
    diff = candidate - reference
    return {"rel_l2": float(np.linalg.norm(diff) / norm) if norm > 0 else float("nan"),
            "max_abs_over_ref_max": float(np.abs(diff).max() / peak) if peak > 0 else float("nan")}


def compare(dump, outputs):
    """[(step, layer, what, errors)] for every (step, layer) the outputs file holds."""
    import h5py

    rows = []
    with h5py.File(outputs, "r") as out, h5py.File(dump + ".module.h5", "r") as side:
        for step in sorted(out["steps"]):
            for layer in sorted(out["steps"][step]):
                group = out["steps"][step][layer]
                w_uv = side[f"layers/{layer}/w_uv"][...]
                module = side[f"steps/{step}/{layer}"]
                attn = module["attn_output"][...]
                o_proj = side[f"layers/{layer}"].get("o_proj_weight")
                for name, what in (("reference_source_out", "source"), ("reference_out", "fp8")):
                    if name not in group:
                        continue
                    mapped = np.einsum("ihc,hvc->ihv", group[name][...], w_uv)
                    rows.append((step, layer, f"{what} after W_UV", _errors(mapped, attn)))
                    if o_proj is not None:
                        y = mapped.reshape(mapped.shape[0], -1) @ o_proj[...].T
                        rows.append((step, layer, f"{what} after o_proj",
                                     _errors(y, module["layer_output"][...])))
    return rows


def _latent_rows(outputs):
    """[(step, layer, "fp8 latent vs Rs", errors)]: R8 against Rs before W_UV."""
    import h5py

    rows = []
    with h5py.File(outputs, "r") as out:
        for step in sorted(out["steps"]):
            for layer in sorted(out["steps"][step]):
                group = out["steps"][step][layer]
                if "reference_out" in group and "reference_source_out" in group:
                    rows.append((step, layer, "fp8 latent vs Rs",
                                 _errors(group["reference_out"][...],
                                         group["reference_source_out"][...])))
    return rows


def layer_scales(dump):
    """{layer group name: kv_scale (float32, as kvaudit reads it)} of a dump."""
    import h5py

    with h5py.File(dump, "r") as f:
        return {name: float(np.float32(f["layers"][name].attrs["kv_scale"]))
                for name in f["layers"]}


def _same_capture(first, other):
    """Refuses `other` unless its side file holds the first dump's module outputs, bit for bit."""
    import h5py

    with h5py.File(first + ".module.h5", "r") as a, h5py.File(other + ".module.h5", "r") as b:
        for step in a["steps"]:
            for layer in a["steps"][step]:
                name = f"steps/{step}/{layer}/attn_output"
                if name not in b or not np.array_equal(a[name][...], b[name][...]):
                    raise CompareError(f"{other}.module.h5:/{name}: not the module output of "
                                       f"{first}: --also takes the same capture at another scale "
                                       "(kvdump.requantize)")


def _outputs_of(dump, outputs):
    """Refuses an outputs file that `kvaudit check --save-outputs` wrote for another dump (its root
    attribute `dump`, the path check was given): the rows would carry this dump's kv_scale."""
    import h5py

    with h5py.File(outputs, "r") as f:
        recorded = f.attrs.get("dump")
    if recorded is None:
        return
    recorded = recorded.decode() if isinstance(recorded, bytes) else str(recorded)
    if os.path.exists(recorded):
        same = os.path.samefile(recorded, dump)
    else:  # check ran elsewhere, or the dump moved since: its file name must still match
        same = os.path.basename(recorded) == os.path.basename(dump)
    if not same:
        raise CompareError(f"{outputs}: saved by kvaudit check for {recorded}, not for {dump}: "
                           "pair each dump with the outputs of its own check")


def compare_runs(runs):
    """FP8's cost per (step, layer) under each run's scale. runs: [(dump, outputs), ...] of one
    capture. Returns [{"run", "dump", "step", "layer", "comparison", "kv_scale", "rel_l2",
    "max_abs_over_ref_max"}]: the source rows of the first run (kv_scale None), then each run's
    fp8 rows (kv_scale of its layer)."""
    for dump, outputs in runs:
        _outputs_of(dump, outputs)
    for dump, _ in runs[1:]:
        _same_capture(runs[0][0], dump)
    rows = []
    for run, (dump, outputs) in enumerate(runs):
        scales = layer_scales(dump)
        for step, layer, what, errors in compare(dump, outputs) + _latent_rows(outputs):
            source = what.startswith("source")
            if source and run > 0:
                continue
            rows.append({"run": run, "dump": dump, "step": step, "layer": layer,
                         "comparison": what, "kv_scale": None if source else scales[layer],
                         **errors})
    order = {"source after W_UV": 0, "source after o_proj": 1, "fp8 latent vs Rs": 2,
             "fp8 after W_UV": 3, "fp8 after o_proj": 4}
    rows.sort(key=lambda r: (r["step"], r["layer"], order[r["comparison"]], r["run"]))
    return rows


def worst_by_scale(rows):
    """Per (run, comparison): the largest rel_l2 over the steps and layers."""
    worst = {}
    for row in rows:
        key = (row["run"], row["comparison"])
        if key not in worst or row["rel_l2"] > worst[key]["rel_l2"]:
            worst[key] = row
    return [worst[key] for key in sorted(worst, key=lambda k: (k[1], k[0]))]


def _table(rows, runs):
    lines = [f"{'step':>5} {'layer':>5} {'comparison':<20} {'rel_l2':>10} {'max_abs/ref_max':>16} "
             f"{'kv_scale':>12}  dump"]
    for row in rows:
        scale = "-" if row["kv_scale"] is None else f"{row['kv_scale']:.6g}"
        dump = "" if row["kv_scale"] is None else f"[{row['run']}]"
        lines.append(f"{row['step']:>5} {row['layer']:>5} {row['comparison']:<20} "
                     f"{row['rel_l2']:>10.3e} {row['max_abs_over_ref_max']:>16.3e} "
                     f"{scale:>12}  {dump}")
    lines.append("worst rel_l2 over the steps and layers:")
    for row in worst_by_scale(rows):
        scale = "" if row["kv_scale"] is None else f" at kv_scale {row['kv_scale']:.6g}"
        lines.append(f"  {row['comparison']:<20} [{row['run']}]{scale}: {row['rel_l2']:.3e} "
                     f"({row['step']} {row['layer']})")
    lines += [f"[{run}] {dump} ({outputs})" for run, (dump, outputs) in enumerate(runs)]
    return "\n".join(lines)


def _json(rows, runs):
    return {"runs": [{"run": run, "dump": dump, "outputs": outputs,
                      "kv_scale": layer_scales(dump)} for run, (dump, outputs) in enumerate(runs)],
            "rows": rows, "worst": worst_by_scale(rows)}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kvdump.hf_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Exit 0 compared, 2 bad input.")
    parser.add_argument("dump")
    parser.add_argument("outputs", help="kvaudit check DUMP --save-outputs OUTPUTS")
    parser.add_argument("--also", nargs=2, action="append", default=[],
                        metavar=("DUMP2", "OUTPUTS2"),
                        help="the same capture at another kv_scale (python -m kvdump.requantize "
                             "DUMP DUMP2 --kv-scale ...) and its saved outputs; repeatable")
    parser.add_argument("--json", metavar="FILE", help="also write every row as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    runs = [(args.dump, args.outputs)] + [tuple(pair) for pair in args.also]
    try:
        rows = compare_runs(runs)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(_json(rows, runs), f, indent=1)
    except CompareError as error:
        print(f"hf_compare: {error}", file=sys.stderr)
        return 2
    except (OSError, KeyError) as error:
        print(f"hf_compare: {' / '.join(d for d, _ in runs)}: {error}", file=sys.stderr)
        return 2
    print(_table(rows, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
