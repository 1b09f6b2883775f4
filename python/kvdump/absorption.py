"""Which matrix a dump's absorbed query was formed with, for a dump kvdump.hf_capture wrote (the
module's W_UK and W_UV beside it in DUMP.module.h5). kvaudit's C++ replay cannot ask this: the
dump holds the absorbed query only, not the module's q_nope nor W_UK / W_UV (docs/design.md,
"Diagnosis of convention mismatches").

    python -m kvdump.absorption DUMP [--side DUMP.module.h5]

The math. The module's query for head h is q_h [Dn]; a server absorbs it into the latent space,
q_abs = q_h W_UK[h] [Dc] (W_UK[h] [Dn, Dc], Dn < Dc), so q_abs lies in the row space of W_UK[h],
a Dn-dimensional subspace of R^Dc. A server that formed it with another matrix M (Dn rows) put it
in the row space of M instead. Per (step, layer, row, head) the residual of q_abs after its
orthogonal projection onto span(M),
    r(M) = || q_abs - P_M q_abs ||_2 / || q_abs ||_2,
is the rounding of q_abs's storage alone when M is the matrix used: each stored element is within
u |x| of the exact product (u = 2^-8 for bf16, 2^-24 for float32, round to nearest), so the
rounding error has norm at most u ||q_abs||, and a projection does not lengthen it; for any
other Dn-dimensional subspace r is of order sqrt(1 - Dn/Dc) (0.5 for the tiny configurations,
0.79 for GLM-5's 192 of 512). A hypothesis explains a layer when its worst r over every row and
head is at most 2u (the factor 2 for the float64 product rounded to float32 before bf16), and only
the hypotheses that fit the dimensions are tried. The hypotheses (real implementation choices):

    w-uk                   q_h W_UK[h]: the module's own absorption (the correct one)
    w-uv                   q_h W_UV[h]: the value matrix (possible only where Dn = Dv: DeepSeek-V3
                           128 = 128; GLM-5's 192 and 256 have no such product)
    w-uk-other-head        q_h W_UK[h'], h' != h: kv_b_proj split with the wrong view, so the
                           heads' blocks shift (the head h' = h + k mod H named)
    w-uk-viewed            q_h V[h], V[h] = W_UK[h]^T [Dc, Dn] reinterpreted as [Dn, Dc] (.view
                           or .reshape where .transpose was meant: W_UK_T kept as vLLM's MLA keeps
                           it, then read with the wrong shape)
"""

import argparse
import enum
import sys

import numpy as np

from .codec import float32_from_bf16_bits


class AbsorptionError(Exception):
    """Bad input: printed as one line, exit 2."""


class Absorption(enum.Enum):
    W_UK = "w-uk"
    W_UV = "w-uv"
    W_UK_OTHER_HEAD = "w-uk-other-head"
    W_UK_VIEWED = "w-uk-viewed"


UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


def _read_query(dataset):
    """q_nope [Nq, H, Dc] as float64, and the unit roundoff of its storage."""
    data = dataset[...]
    if data.dtype == np.uint16:  # kvdump's bf16: the bits (docs/kvdump-v1.md)
        return float32_from_bf16_bits(data).astype(np.float64), UNIT_ROUNDOFF["bfloat16"]
    if data.dtype == np.float32:
        return data.astype(np.float64), UNIT_ROUNDOFF["float32"]
    raise AbsorptionError(f"{dataset.file.filename}: {dataset.name}: q_nope is {data.dtype}, "
                          "expected bf16 bits (uint16) or float32")


def _row_space_basis(matrix):
    """An orthonormal basis [Dc, rank] of the row space of `matrix` [Dn, Dc]."""
    u, s, vt = np.linalg.svd(matrix, full_matrices=False)
    rank = int((s > s.max() * max(matrix.shape) * np.finfo(np.float64).eps).sum())
    return vt[:rank].T


def _residuals(q, basis):
    """r per query row [Nq]: q [Nq, Dc], basis [Dc, rank]."""
    projected = (q @ basis) @ basis.T
    norms = np.linalg.norm(q, axis=-1)
    safe = np.where(norms > 0, norms, 1.0)
    return np.where(norms > 0, np.linalg.norm(q - projected, axis=-1) / safe, 0.0)


def candidate_matrices(w_uk, w_uv):
    """{(Absorption, shift or None): [H, Dn, Dc] per head}: the matrices each hypothesis absorbs
    head h's query with, where the dimensions allow it."""
    heads, dn, dc = w_uk.shape
    candidates = {(Absorption.W_UK, None): w_uk}
    if w_uv.shape[1] == dn:
        candidates[(Absorption.W_UV, None)] = w_uv
    for shift in range(1, heads):
        candidates[(Absorption.W_UK_OTHER_HEAD, shift)] = np.roll(w_uk, -shift, axis=0)
    viewed = np.stack([np.ascontiguousarray(w_uk[h].T).reshape(dn, dc) for h in range(heads)])
    candidates[(Absorption.W_UK_VIEWED, None)] = viewed
    return candidates


def layer_residuals(queries, w_uk, w_uv):
    """{(Absorption, shift): worst r over every row and head} for one layer; queries: the steps'
    q_nope [Nq, H, Dc] arrays."""
    worst = {}
    for key, matrices in candidate_matrices(w_uk, w_uv).items():
        largest = 0.0
        for h in range(w_uk.shape[0]):
            basis = _row_space_basis(matrices[h])
            for q in queries:
                largest = max(largest, float(_residuals(q[:, h, :], basis).max(initial=0.0)))
        worst[key] = largest
    return worst


def _name(key):
    absorption, shift = key
    return absorption.value if shift is None else f"{absorption.value} (h + {shift})"


def diagnose(dump, side=None):
    """[(layer, explaining names, {name: worst r}, bound)] for every layer of the side file."""
    import h5py

    side = side or dump + ".module.h5"
    findings = []
    try:
        with h5py.File(dump, "r") as f, h5py.File(side, "r") as s:
            for layer in sorted(s["layers"]):
                w_uk = s[f"layers/{layer}/w_uk"][...].astype(np.float64)
                w_uv = s[f"layers/{layer}/w_uv"][...].astype(np.float64)
                queries, unit = [], 0.0
                for step in sorted(f["steps"]):
                    q, u = _read_query(f[f"steps/{step}/{layer}/q_nope"])
                    queries.append(q)
                    unit = max(unit, u)
                worst = layer_residuals(queries, w_uk, w_uv)
                bound = 2.0 * unit
                explaining = [_name(k) for k, r in worst.items() if r <= bound]
                findings.append((layer, explaining, {_name(k): r for k, r in worst.items()},
                                 bound))
    except (OSError, KeyError) as error:
        raise AbsorptionError(f"{dump} / {side}: {error}") from error
    return findings


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m kvdump.absorption",
        description="Which matrix the absorbed query of a kvdump.hf_capture dump was formed with: "
                    "the residual of each row's q_nope outside the row space of W_UK[h] (the "
                    "module's own absorption), W_UV[h], another head's W_UK, or W_UK^T read "
                    "with the wrong shape. Exit 0: W_UK alone explains every layer; 1: another "
                    "matrix, or none; 2: bad input.")
    parser.add_argument("dump")
    parser.add_argument("--side", help="the module side file (default DUMP.module.h5)")
    args = parser.parse_args(argv)
    try:
        findings = diagnose(args.dump, args.side)
    except AbsorptionError as error:
        print(f"kvdump.absorption: {error}", file=sys.stderr)
        return 2
    status = 0
    for layer, explaining, worst, bound in findings:
        closest = min(worst, key=worst.get)
        what = ", ".join(explaining) if explaining else f"none (closest {closest})"
        print(f"{layer}: absorbed with {what}; worst residual outside each row space "
              f"(explains at <= {bound:.3g}): "
              + ", ".join(f"{name} {r:.3g}" for name, r in sorted(worst.items(),
                                                                     key=lambda x: x[1])[:4]))
        if explaining != [Absorption.W_UK.value]:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
