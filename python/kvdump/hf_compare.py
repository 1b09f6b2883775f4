"""What kvaudit's references mean at the model's layer output, for a dump kvdump.hf_capture wrote:
kvaudit's latent outputs (`kvaudit check DUMP --save-outputs OUTPUTS`) mapped through the
module's W_UV (and o_proj, where the side file holds it), against the module's own outputs.

    python -m kvdump.hf_compare DUMP OUTPUTS

Per (step, layer), with A the module's attention output [Nq, H, Dv] (o_proj's input) and Y its
layer output [Nq, hidden] (DUMP.module.h5):
    source: W_UV Rs   vs A   (Rs: exact attention on the unquantized rows; agreement, ~2^-24)
    fp8:    W_UV R8   vs A   (R8: exact attention on the FP8 pool: what FP8 storage costs after
                              W_UV) and o_proj(W_UV R8) vs Y (after o_proj, when stored)
Each as rel_l2 = ||x - ref||_2 / ||ref||_2 and max_abs / max|ref|.
"""

import argparse
import sys

import numpy as np


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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kvdump.hf_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump")
    parser.add_argument("outputs", help="kvaudit check DUMP --save-outputs OUTPUTS")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rows = compare(args.dump, args.outputs)
    except (OSError, KeyError) as error:
        print(f"hf_compare: {args.dump} / {args.outputs}: {error}", file=sys.stderr)
        return 2
    print(f"{'step':>5} {'layer':>5} {'comparison':<20} {'rel_l2':>10} {'max_abs/ref_max':>16}")
    for step, layer, what, errors in rows:
        print(f"{step:>5} {layer:>5} {what:<20} {errors['rel_l2']:>10.3e} "
              f"{errors['max_abs_over_ref_max']:>16.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
