"""A decode step's kernel pattern without attention: per layer RMSNorm (Triton) -> qkv (fused) -> silu_mul
(Triton, a stand-in for rope + attention) -> o (fused) -> add+RMSNorm -> gate_up (fused) -> silu_mul ->
down (fused); 8 layers of 7B shapes in one CUDA graph. argv[1]: label; GDC=1: the Triton kernels
launched with PDL (gdc_wait and gdc_launch_dependents at their start)."""
import os, sys
sys.path.insert(0, "bench")
import torch, triton, triton.language as tl
from fixedrate_gpu import graph_ms
from gpu_bench import weights
from cuda_ext import fixedrate as fr
GDC = os.environ.get("GDC") == "1"

@triton.jit
def norm_k(x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, cols, eps, HAS_H: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = c < cols
    x = tl.load(x_ptr + row * cols + c, mask=inside, other=0.0).to(tl.float32)
    if HAS_H:
        h = tl.load(h_ptr + row * cols + c, mask=inside, other=0.0).to(tl.float32)
        x = x + h
        tl.store(sum_ptr + row * cols + c, x.to(tl.bfloat16), mask=inside)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / cols + eps)
    w = tl.load(w_ptr + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + c, (w * x * inv).to(tl.bfloat16), mask=inside)

@triton.jit
def silu_k(g_ptr, u_ptr, out_ptr, cols, g_row, u_row, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < cols
    g = tl.load(g_ptr + row * g_row + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + c, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16), mask=inside)

def norm(x, h, w):
    n, e = x.shape
    total = x if h is None else torch.empty_like(x)
    out = torch.empty_like(x)
    kw = dict(launch_pdl=True) if GDC else {}
    norm_k[(n,)](x, x if h is None else h, w, total, out, e, 1e-5, HAS_H=h is not None, BLOCK=4096, USE_GDC=GDC, num_warps=8, **kw)
    return total, out

def silu(g, u):
    n, f = g.shape
    out = torch.empty((n, f), dtype=g.dtype, device=g.device)
    kw = dict(launch_pdl=True) if GDC else {}
    silu_k[(n, triton.cdiv(f, 1024))](g, u, out, f, g.stride(0), u.stride(0), BLOCK=1024, USE_GDC=GDC, num_warps=4, **kw)
    return out

shapes = {"qkv": (12288, 4096), "o": (4096, 4096), "gu": (22016, 4096), "down": (4096, 11008)}
layers = []
for i in range(8):
    ws = weights(shapes, seed=10 + i)
    layers.append({k: fr.encode(w.cuda()) for k, w in ws.items()})
nw = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
out = []
for n in (1, 32):
    x0 = torch.randn(n, 4096, device="cuda").bfloat16()
    def step():
        x, h = x0, None
        for L in layers:
            x, a = norm(x, h, nw)
            q = fr.linear(a, L["qkv"])
            a = silu(q[:, :4096], q[:, 4096:8192])
            o = fr.linear(a, L["o"])
            x, a = norm(x, o, nw)
            g = fr.linear(a, L["gu"])
            a = silu(g[:, :11008], g[:, 11008:])
            h = fr.linear(a, L["down"])
        return x, h
    out.append(f"n={n} {graph_ms(step, 5) * 1e3:.1f} us")
print(sys.argv[1], "GDC" if GDC else "", " ".join(out), flush=True)
