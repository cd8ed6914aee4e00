"""The reference of linear16's sums (csrc/linear16.cpp) on a CPU without AVX512-BF16 and in its
scalar loop: y[r, o] = round_to_dtype(s_K + b[o]), where s_0 = +0 and s_{k+1} = fl32(s_k + w[o, k] x[r, k]),
one rounding a step (a fused multiply-add), k in order. The products of two 16-bit floats are
exact; the sum of each step is rounded once to float32. Slow (a loop over K), obviously right.

Read me first.
* PyTorch has no fused multiply-add, and a float32 product followed by a float32 add rounds twice
  where the product falls outside float32's normal range (bf16 x bf16 may). So each step is done
  in float64, where the product is exact: the sum s + p rounded to float64, its rounding error
  found exactly (TwoSum), and an inexact sum with an even last bit moved one place toward the
  exact sum (rounding to odd). Rounding that to float32 is then the sum rounded once: float64 has
  more than 24 + 2 bits (Boldo and Melquiond, "When double rounding is odd", 2005).
* On an AVX512-BF16 CPU, linear16 of a bf16 weight runs vdpbf16ps instead (each pair's two
  products added in turn, subnormals flushed): that loop is checked against a float64 bound, not
  against this reference.
"""
from __future__ import annotations

import torch


def fma32(s: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fl32(s + w x), rounded once: s float32, w and x float32 holding 16-bit floats (broadcast)."""
    sd, p = s.double(), w.double() * x.double()                    # p exact: 8 + 8 or 11 + 11 bits
    t = sd + p                                                     # rounded to float64
    back = t - sd
    err = (sd - (t - back)) + (p - back)                           # t + err = sd + p exactly (TwoSum)
    even = (t.view(torch.int64) & 1) == 0
    inexact = (err != 0) & err.isfinite() & even
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(t)
    return torch.where(inexact, torch.nextafter(t, toward), t).float()       # round to odd, then to float32


def linear16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear16(x, weight, bias) as the FMA and scalar loops compute it: x [..., K], weight [N, K]
    and bias [N] of one 16-bit dtype -> [..., N] of that dtype."""
    xf = x.reshape(-1, weight.shape[1]).float()                    # [R, K]
    wf = weight.float()                                            # [N, K]
    s = torch.zeros(xf.shape[0], wf.shape[0])                      # [R, N], +0
    for k in range(wf.shape[1]):
        s = fma32(s, wf[:, k], xf[:, k:k + 1])
    if bias is not None:
        s = s + bias.float()
    return s.to(weight.dtype).view(*x.shape[:-1], weight.shape[0])
