"""The kernel ``ptx_jit.check_jit`` loads through the driver's JIT: a separate module, so that
importing ``ptx_jit`` imports no Triton."""

import triton
import triton.language as tl


@triton.jit
def probe_kernel(X, n, BLOCK: tl.constexpr):
    # X[:n] += 1: enough to see the PTX load, launch and compute
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(X + o, tl.load(X + o, mask=m) + 1.0, mask=m)
