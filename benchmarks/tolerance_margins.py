"""How close the float32 backward comes to the tolerance rule, over many seeds (GPU).

Usage: python benchmarks/tolerance_margins.py [--seeds N] [--dtype float32]

For each problem (the awkward test shapes, causal and not, and the dropout tests' one-query-row
problem) and each seed it prints nothing; at the end, per problem and gradient, the largest
error / bound with the noise floor `reference.gradient_term_magnitudes` gives, and with that floor
divided by its exponent factor (max(1, |s|, |lse|): the floor before session 14). A ratio above 1
is a test failure. No timing; the kernels run exactly as `attention_backward` runs them.
"""

import argparse
import sys

import numpy

import cupyflash
from cupyflash import reference

PROBLEMS = [  # (batch, seqlen_q, seqlen_k, heads, head_dim, scale factor, dropout_p, strided)
    (2, 1, 1, 3, 1, 1.0, 0.0, False),
    (2, 1, 17, 3, 40, 1.0, 0.0, False),
    (2, 17, 1, 3, 59, 1.0, 0.0, False),
    (2, 113, 203, 3, 111, 1.0, 0.0, False),
    (2, 1023, 1024, 3, 40, 1.0, 0.0, False),
    (3, 1, 17, 2, 111, 1.5, 0.3, True),  # test_dropout_gpu.py::test_awkward_shapes' third problem
]


def margins(rng, dtype, problem, causal):
    import cupy

    batch, sq, sk, heads, d, factor, dropout_p, strided = problem
    dt = numpy.dtype(dtype)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, n, heads, d)).astype(dt)) for n in (sq, sk, sk, sq))
    if strided:
        q, k, v = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
    options = {"causal": causal, "scale": factor / d**0.5}
    if dropout_p:
        options.update(dropout_p=dropout_p, seed=int(rng.integers(0, 2**62)), offset=int(rng.integers(0, 2**32)))
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **options)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, **options)
    dout, q, k, v = (cupy.asnumpy(x).astype(numpy.float64) for x in (dout, q, k, v))
    exact = reference.attention_backward(dout, q, k, v, **options)
    lowp = reference.attention_backward_in_precision(*(x.astype(dt) for x in (dout, q, k, v)), dt, **options)
    magnitudes = reference.gradient_term_magnitudes(dout, q, k, v, **options)
    size = reference.gradient_exponent_size(q, k, v, **options)
    ratios = []
    for got, ref, base, magnitude in zip(grads, exact, lowp, magnitudes):
        err = numpy.abs(cupy.asnumpy(got).astype(numpy.float64) - ref).max(initial=0.0)
        ratios.append((err / reference.error_bound(ref, base, dtype, magnitude),
                       err / reference.error_bound(ref, base, dtype, magnitude / size)))
    return ratios, size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args(argv)
    import cupy

    rng = numpy.random.default_rng()
    print("device:", cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode())
    print(f"{'problem (b, sq, sk, h, d, scale x, p, strided)':<48} {'causal':>6} {'exp':>5}"
          f" {'dq now':>7} {'dk now':>7} {'dv now':>7} {'dq old':>7} {'dk old':>7} {'dv old':>7}")
    failures = 0
    for problem in PROBLEMS:
        for causal in (False, True):
            worst_now, worst_old, sizes = [0.0] * 3, [0.0] * 3, []
            for _ in range(args.seeds):
                ratios, size = margins(rng, args.dtype, problem, causal)
                sizes.append(size)
                for i, (now, old) in enumerate(ratios):
                    worst_now[i], worst_old[i] = max(worst_now[i], now), max(worst_old[i], old)
            failures += sum(r > 1 for r in worst_now)
            print(f"{str(problem):<48} {str(causal):>6} {max(sizes):5.1f}"
                  + "".join(f" {r:7.3f}" for r in worst_now + worst_old))
    print(f"largest error / bound over {args.seeds} seeds each; 'old': the floor without the exponent factor")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
