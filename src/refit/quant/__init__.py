"""Changing the bytes on the way: blockwise FP8 quantization (``fp8``; the one-pass Triton kernel in
``fp8_triton``)."""

from refit.quant.fp8 import (
    AMAX_FLOOR,
    FP8,
    FP8_MAX,
    SCALE_SUFFIX,
    Fp8Quantizer,
    default_fp8_tensors,
    dequantize_fp8_block,
    expected_fp8,
    fp8_layout,
    quantize_fp8_block,
    quantize_into,
    quantized_names,
    scale_name,
    use_triton,
)

__all__ = [
    "AMAX_FLOOR",
    "FP8",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "Fp8Quantizer",
    "default_fp8_tensors",
    "dequantize_fp8_block",
    "expected_fp8",
    "fp8_layout",
    "quantize_fp8_block",
    "quantize_into",
    "quantized_names",
    "scale_name",
    "use_triton",
]
