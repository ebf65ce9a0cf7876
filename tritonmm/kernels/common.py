"""JIT helpers shared by the GEMM kernels: group-M program order, the epilogue activation, the output rounding."""

import triton
import triton.language as tl


@triton.jit
def _group_m_order(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Group-M swizzle (Triton tutorial 03): GROUP_M rows of tiles are visited column by column."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _to_output(acc, dtype, UPCAST: tl.constexpr):
    """fp32 accumulator -> output dtype, rounding to nearest even.

    Under the interpreter (UPCAST) bfloat16 is rounded by hand: its fp32 -> bf16 cast truncates.
    """
    if dtype == tl.float32:  # split-K partial sums stay fp32 (one rounding, after the reduction)
        return acc
    elif UPCAST:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(acc != acc, acc.to(dtype), out)
    else:
        return acc.to(dtype)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """Elementwise activation on fp32 values; NaN propagates as in torch."""
    if ACTIVATION == "relu":
        x = tl.where(x < 0.0, 0.0, x)
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # tanh(inner) = 2 sigmoid(2 inner) - 1 is exactly +-1 in fp32 past |inner| = 20; clamping there
        # changes no result and keeps exp(-2 inner) finite (the interpreter's NumPy warned of overflow)
        inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)
        x = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    return x
