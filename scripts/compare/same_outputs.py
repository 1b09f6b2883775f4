"""Compares the backend outputs of two `kvaudit check --save-outputs` files bit for bit: every
/steps/S###/L###/backend_out (bf16 bits) and backend_lse (fp32 bits) of the first file must exist
in the second with the same dtype, shape and bytes. Prints one line (SAME or DIFFER, the datasets
and elements compared, the first differing datasets); exits 0 when the same, 1 otherwise.
Used by scripts/compare/gpu-compare-binaries.sh.

    python3 scripts/compare/same_outputs.py BASE.h5 NEW.h5
"""
import sys

import h5py

COMPARED = ("backend_out", "backend_lse")


def compare(path_a, path_b):
    with h5py.File(path_a, "r") as a, h5py.File(path_b, "r") as b:
        names = []
        a.visititems(lambda name, obj: names.append(name)
                     if isinstance(obj, h5py.Dataset) and name.rsplit("/", 1)[-1] in COMPARED
                     else None)
        elements, differing = 0, []
        for name in names:
            x = a[name][()]
            y = b[name][()] if name in b else None
            elements += x.size
            if y is None or x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                differing.append(name)
        return names, elements, differing


def main():
    names, elements, differing = compare(sys.argv[1], sys.argv[2])
    same = bool(names) and not differing
    line = f"{'SAME' if same else 'DIFFER'}: {len(names)} datasets, {elements} elements"
    if differing:
        line += f", differing: {differing[:5]}"
    print(line)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
