"""Argument types the kvdump command lines share (argparse `type=` callables)."""

import argparse


def layer_list(text):
    """'0,2,5' -> [0, 2, 5]: a comma list of layer ids >= 0, sorted, duplicates dropped."""
    try:
        layers = sorted({int(part) for part in text.split(",") if part != ""})
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma list of layer ids") from None
    if not layers or layers[0] < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma list of layer ids >= 0")
    return layers
