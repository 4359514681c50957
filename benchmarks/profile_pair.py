"""Runs cupyflash and PyTorch's flash backend once each on the same inputs, for a profiler.

    ncu --clock-control none -k regex:'flash_(fwd|bwd)' python benchmarks/profile_pair.py --head-dim 128

Forward then backward, cupyflash first; one warm-up call each (compilation, autotuning) is made
before cupy.cuda.profiler.start() so that `ncu --profile-from-start off` sees only the timed pair.
A development tool: no timing of its own.
"""

import argparse
import sys

import numpy


def main(argv=None):
    import cupy
    import torch

    import cupyflash

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--direction", choices=["fwd", "bwd", "both"], default="both")
    args = ap.parse_args(argv)
    b, s, d = max(1, 16384 // args.seqlen), args.seqlen, args.head_dim
    h = 2048 // d
    tdtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=tdtype, generator=gen) for _ in range(4))
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, dout))

    def ours_fwd():
        return cupyflash.attention(cq, ck, cv, causal=args.causal, return_lse=True)

    def ours_bwd(out, lse):
        return cupyflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=args.causal)

    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

    def torch_fwd():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)

    def torch_bwd(o):
        torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2))

    for profiled in (False, True):
        if profiled:
            torch.cuda.synchronize()
            cupy.cuda.profiler.start()
        out, lse = ours_fwd()
        if args.direction != "fwd":
            ours_bwd(out, lse)
        o = torch_fwd()
        if args.direction != "fwd":
            torch_bwd(o)
        torch.cuda.synchronize()
    cupy.cuda.profiler.stop()
    print(f"profiled b{b} s{s} h{h} d{d} {args.dtype} causal={args.causal}: {numpy.prod(out.shape)} outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
