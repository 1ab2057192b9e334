#!/usr/bin/env python3
"""Writes fixture.safetensors with Python's safetensors library, for kiln's interop test.

    pip install safetensors numpy && python3 tests/nn/data/make_fixture.py

The values are spelled out again in tests/nn/safetensors_test.cpp (SafetensorsInterop); keep
the two in step. numpy has no bfloat16, so the BF16 tensor goes through the library's own
serializer as raw bit patterns (the top 16 bits of float32 values that bf16 holds exactly).
"""
import os

import numpy as np
from safetensors import TensorSpec, serialize

HERE = os.path.dirname(os.path.abspath(__file__))


def fixture_tensors():
    """The numpy tensors of the fixture and the float32 values of its BF16 tensor "bf16"."""
    tensors = {
        "f32": np.array([[1.5, -2.25, 3.0], [0.1, 1e-8, -7.75]], dtype=np.float32),
        "f64": np.array([1.0 / 3.0, -2.5, 1e300], dtype=np.float64),
        "f16": np.array([[0.5, -1.0], [65504.0, 2.0**-14]], dtype=np.float16),
        "i64": np.array([-(2**40), 0, 2**62], dtype=np.int64),
        "i32": np.array([[-7, 2**31 - 1], [-(2**31), 42]], dtype=np.int32),
        "bool": np.array([True, False, True, True, False]),
        "scalar": np.array(42.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "layers.0.ünicode": np.array([7], dtype=np.int32),
    }
    bf16 = np.array([1.0, -2.5, 3.140625, 256.0], dtype=np.float32)
    return tensors, bf16
METADATA = {"format": "np", "producer": "make_fixture.py"}


def bf16_bits(values):
    """bfloat16 bit patterns of float32 values that bf16 holds exactly (their top 16 bits)."""
    assert np.all((values.view(np.uint32) & 0xFFFF) == 0), "not exact in bfloat16"
    return (values.view(np.uint32) >> 16).astype("<u2")


def main():
    tensors, bf16 = fixture_tensors()
    bits = bf16_bits(bf16)
    # TensorSpec + serialize is the library's own writer (what safetensors.numpy.save calls);
    # the arrays must stay alive until serialize returns.
    specs = {
        name: TensorSpec(dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data,
                         data_len=a.nbytes)
        for name, a in tensors.items()
    }
    specs["bf16"] = TensorSpec(dtype="bfloat16", shape=[4], data_ptr=bits.ctypes.data,
                               data_len=bits.nbytes)
    data = serialize(specs, metadata=METADATA)
    with open(os.path.join(HERE, "fixture.safetensors"), "wb") as f:
        f.write(bytes(data))


if __name__ == "__main__":
    main()
