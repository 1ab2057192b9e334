#!/usr/bin/env python3
"""Checks, with Python's safetensors library, a file that kiln wrote (the reverse interop test).

    python3 tests/nn/data/check_kiln_file.py FILE

FILE must hold the fixture's tensors and metadata (make_fixture.py), as the C++ test
SafetensorsInterop.KilnFileLoadsInPython writes them; it runs this script when python3 can
import safetensors and numpy, and skips otherwise. Exit status 0 and "OK" mean every tensor
matched in dtype, shape and exact value.
"""
import sys

import numpy as np
from safetensors import deserialize, safe_open

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from make_fixture import METADATA, bf16_bits, fixture_tensors


def main(path):
    tensors, bf16 = fixture_tensors()
    expected = {name: (a.dtype.name, list(a.shape), a.tobytes()) for name, a in tensors.items()}
    expected["bf16"] = ("bfloat16", [4], bf16_bits(bf16).tobytes())
    st_names = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64",
                "int32": "I32", "bool": "BOOL", "bfloat16": "BF16"}

    # The library's own parser and validator, over the raw bytes: every tensor, BF16 included.
    with open(path, "rb") as f:
        raw = dict(deserialize(f.read()))
    assert sorted(raw) == sorted(expected), (sorted(raw), sorted(expected))
    for name, (dtype, shape, data) in expected.items():
        got = raw[name]
        assert got["dtype"] == st_names[dtype], (name, got["dtype"], dtype)
        assert list(got["shape"]) == shape, (name, got["shape"], shape)
        assert bytes(got["data"]) == data, (name, bytes(got["data"]), data)

    # The numpy front end (which has no bfloat16) and the metadata.
    with safe_open(path, framework="np") as f:
        assert f.metadata() == METADATA, f.metadata()
        for name, a in tensors.items():
            b = f.get_tensor(name)
            assert b.dtype == a.dtype and b.shape == a.shape, (name, b.dtype, b.shape)
            assert np.array_equal(a, b), (name, a, b)
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
