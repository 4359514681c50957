"""cupyflash attention as a differentiable PyTorch function.

    import cupyflash.torch
    out = cupyflash.torch.attention(q, k, v, causal=True)   # q, k, v: torch tensors
    out.sum().backward()                                     # runs cupyflash.attention_backward

Tensors have the layout of `cupyflash.attention`: (batch, seq, heads, head_dim); a
(batch, heads, seq, head_dim) tensor passes as ``x.transpose(1, 2)`` without a copy. CUDA tensors
are read in place, the kernels run on PyTorch's current stream of their device, and the results
are allocated by torch's caching allocator (as its own operators' are). CPU tensors take
`cupyflash.attention`'s host path.
Importing this module imports torch, which cupyflash does not otherwise need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers

import numpy
import torch

from cupyflash.api import common, varlen
from cupyflash.frameworks import arrays as frameworks
from cupyflash.problem import Options, lse_dtype
from cupyflash.runtime import workspace
from cupyflash.validation import BFLOAT16

__all__ = ["attention", "attention_varlen", "scaled_dot_product_attention", "FlashAttentionFunction",
           "FlashAttentionVarlenFunction"]

_CUPY_DTYPES = {torch.float16: numpy.float16, torch.bfloat16: BFLOAT16, torch.float32: numpy.float32,
                torch.float64: numpy.float64}
_NUMPY_DTYPES = {t: numpy.dtype(d) for t, d in _CUPY_DTYPES.items()}

# torch's own SDPA, taken when this module is imported: what scaled_dot_product_attention hands on
# the calls its kernels do not take, also after a program has set
# torch.nn.functional.scaled_dot_product_attention to it (looked up at call time, it found itself
# and recursed without end).
_torch_sdpa = torch.nn.functional.scaled_dot_product_attention


def attention(
    q, k, v, *, causal=False, scale=None, deterministic=False, block_mask=None, window=None, softcap=None,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, return_lse=False,
):
    """`cupyflash.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
    alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)` for torch tensors
    (k, v with fewer heads for GQA/MQA), with a backward pass (`cupyflash.attention_backward`) for
    autograd. `deterministic=True` makes the gradients bitwise reproducible (see
    attention_backward). With a `cupyflash.BlockMask` as block_mask,
    `cupyflash.block_sparse_attention` and its backward. The ALiBi slopes (a tensor or array) get
    no gradient. With dropout_p > 0 and no seed, the seed and offset come from torch's generator of
    q's device (`torch.cuda.manual_seed` makes CUDA calls reproducible, `torch.manual_seed` CPU
    ones), whose offset each call advances, as flash-attn draws its Philox state; the backward
    reuses them. Returns out, or (out, lse) with return_lse=True (lse gets no gradient)."""
    if isinstance(alibi_slopes, torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    seed, offset = dropout_seed(dropout_p, seed, offset, q)
    options = Options(causal=causal, scale=scale, deterministic=deterministic, block_mask=block_mask, window=window,
                      softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
                      return_lse=True)
    out, lse = FlashAttentionFunction.apply(q, k, v, options)
    return (out, lse) if return_lse else out


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False, scale=None,
    deterministic=False, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
    return_lse=False,
):
    """`cupyflash.attention_varlen` for packed torch tensors (total, heads, head_dim) with integer
    cu_seqlens tensors (or arrays), with `cupyflash.attention_varlen_backward` for autograd
    (the lengths and ALiBi slopes get no gradient); dropout as `attention`. Returns out, or
    (out, lse) with return_lse=True, lse (heads, total_q) without gradient."""
    dropout = (dropout_p, *dropout_seed(dropout_p, seed, offset, q))
    out, lse = FlashAttentionVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  causal, scale, deterministic, window, softcap, alibi_slopes, dropout)
    return (out, lse) if return_lse else out


# Philox offsets a call takes from torch's CUDA generator: it keeps them in multiples of 4.
_OFFSET_STEP = 4


def dropout_seed(dropout_p, seed, offset, x) -> tuple:
    """(seed, offset): as given, or with dropout and no seed, drawn from torch's generator of x's
    device. A CUDA generator gives its seed and its Philox offset, which the call advances (no
    device work, no synchronisation: flash-attn's way); the CPU generator a random seed."""
    if seed is not None or not (isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool)
                                and dropout_p > 0):
        return seed, offset
    if isinstance(x, torch.Tensor) and x.is_cuda:
        generator = torch.cuda.default_generators[x.device.index if x.device.index is not None else
                                                   torch.cuda.current_device()]
        position = generator.get_offset()
        generator.set_offset(position + _OFFSET_STEP)
        if not isinstance(offset, numbers.Integral) or isinstance(offset, bool):
            return generator.initial_seed(), offset  # the checks name what is wrong with it
        return generator.initial_seed(), (offset + position // _OFFSET_STEP) % 2**32
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64)), offset


def _view(x) -> frameworks.DeviceView:
    """A CUDA tensor that `_on_gpu` took, as the kernels read it in place."""
    itemsize = x.element_size()
    return frameworks.DeviceView(x.data_ptr(), tuple(x.shape), tuple(s * itemsize for s in x.stride()),
                                 _NUMPY_DTYPES[x.dtype], x.device.index, x)


def _as_torch(x):
    """A result of the generic path as a torch tensor (DLPack, no copy)."""
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def _on_gpu(*tensors) -> bool:
    """Whether the kernels take these tensors in place: CUDA tensors of the dtypes they read. Others
    (CPU tensors, other dtypes, empty ones) go the generic way, whose checks name what is wrong."""
    return all(isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in _CUPY_DTYPES and x.numel() for x in tensors)


def empty(shape, dtype, device):
    """Result allocation from torch's caching allocator, on its current stream (tests fill it with
    NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(x):
    """A gradient for x: x's strides where x is dense (autograd would otherwise copy it to them)."""
    return torch.empty_like(x)


# CuPy streams wrapping torch's, by (device, cudaStream_t): one per stream a process uses, not one a
# call.
_STREAMS: dict = {}
_STREAMS_KEPT = 64


class _TorchStream:
    """`with _TorchStream(x):` runs CuPy on x's device and PyTorch's current stream there."""

    __slots__ = ("device", "stream")

    def __init__(self, x):
        import cupy

        index = x.device.index
        self.device = cupy.cuda.Device(index)
        handle = torch.cuda.current_stream(index).cuda_stream
        stream = _STREAMS.get((index, handle))
        if stream is None:
            with self.device:
                stream = frameworks.external_stream(handle, index)
            workspace.keep_bounded(_STREAMS, (index, handle), stream, _STREAMS_KEPT)
        self.stream = stream

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


def _on_torch_stream(x):
    """CuPy's current stream set to PyTorch's current stream on x's device (nothing for CPU)."""
    return _TorchStream(x) if x.is_cuda else contextlib.nullcontext()


_LSE_DTYPES = {numpy.dtype(numpy.float32): torch.float32, numpy.dtype(numpy.float64): torch.float64}


class FlashAttentionFunction(torch.autograd.Function):
    """Forward: out, lse = cupyflash.attention(...); saves q, k, v, out, lse (O(seqlen) extra) and
    returns both (lse without gradient). Backward: cupyflash.attention_backward, recomputing the
    attention matrix tile by tile. CUDA tensors are read in place and the results allocated by
    torch; other tensors take `cupyflash.attention`'s generic path (DLPack, and its checks)."""

    @staticmethod
    def forward(ctx, q, k, v, options: Options):
        if options.return_lse is not True:  # (lse is saved for the backward)
            options = dataclasses.replace(options, return_lse=True)
        if _on_gpu(q, k, v):
            with _TorchStream(q):
                arrays, origins = common.ingest({"q": _view(q), "k": _view(k), "v": _view(v)})
                p = common.checked_problem("forward", arrays, origins, options)
                out_shape, lse_shape = common.forward_shapes(p)
                out = empty(out_shape, q.dtype, q.device)
                lse = empty(lse_shape, _LSE_DTYPES[lse_dtype(p.dtype_name)], q.device)
                common.forward_gpu(*arrays.values(), p, _view(out), _view(lse))
        else:
            # DLPack refuses tensors that require grad; the kernels only read them.
            given = dict(zip(("q", "k", "v"), (x.detach() if isinstance(x, torch.Tensor) else x for x in (q, k, v))))
            with _on_torch_stream(q):
                out, lse = map(_as_torch, common.forward_call(given, options))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.dim() == 4 and dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum()
            dout = dout.contiguous()
        if _on_gpu(dout, q, k, v, out, lse):
            with _TorchStream(q):
                given = dict(zip(common.BACKWARD_ARRAYS, map(_view, (dout, q, k, v, out, lse))))
                arrays, origins = common.ingest(given)
                p = common.checked_problem("backward", arrays, origins, ctx.options)
                grads = tuple(empty_like(x) for x in (q, k, v))
                if p.seqlens_k is not None:  # padding keys are no block's to write: their gradient is 0
                    grads[1].zero_()
                    grads[2].zero_()
                common.backward_gpu(*arrays.values(), p, tuple(map(_view, grads)))
        else:
            given = dict(zip(common.BACKWARD_ARRAYS, (x.detach() for x in (dout, q, k, v, out, lse))))
            with _on_torch_stream(q):
                grads = tuple(map(_as_torch, common.backward_call(given, ctx.options)))
        return (*grads, None)


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """As FlashAttentionFunction, for `cupyflash.attention_varlen` and its backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, deterministic,
                window, softcap, alibi_slopes, dropout=(0.0, None, 0)):
        q, k, v = (x.detach() for x in (q, k, v))
        if isinstance(alibi_slopes, torch.Tensor):
            alibi_slopes = alibi_slopes.detach()
        cu_seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        options = dict(causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                       dropout_p=dropout[0], seed=dropout[1], offset=dropout[2])
        with _on_torch_stream(q):
            out, lse = varlen.attention_varlen(q, k, v, *cu_seqlens, return_lse=True, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens, ctx.options = cu_seqlens, dict(options, deterministic=deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = (x.detach() for x in ctx.saved_tensors)
        dout = dout.detach()
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        with _on_torch_stream(q):
            dq, dk, dv = varlen.attention_varlen_backward(dout, q, k, v, out, lse, *ctx.cu_seqlens, **ctx.options)
        return (dq, dk, dv) + (None,) * 11


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` computed by cupyflash, with autograd:
    the same signature, (batch, heads, seq, head_dim) layout (or (batch, seq, head_dim), one head)
    and result, so that it can stand in for SDPA.

    is_causal is SDPA's: query i sees keys 0..i, the mask aligned top-left (cupyflash's causal
    aligns bottom-right; the two agree when the lengths are equal). enable_gqa lets key and value
    have fewer heads, a divisor of query's. dropout_p applies whenever it is > 0, as in SDPA, with
    the seed drawn as `attention` draws it. The result is a (batch, heads, seq, head_dim) view of
    cupyflash's (batch, seq, heads, head_dim) output, not a contiguous tensor.

    What cupyflash's kernels do not take goes to torch's own SDPA, unchanged: an attn_mask (boolean
    or additive), a value head dim other than the query's, other numbers of dimensions, and key
    heads that differ from the query's without enable_gqa (which SDPA refuses)."""
    plain = (attn_mask is None and query.dim() in (3, 4) and key.dim() == value.dim() == query.dim()
             and value.shape[-1] == query.shape[-1]
             and (query.dim() == 3 or enable_gqa or key.shape[-3] == query.shape[-3]))
    if not plain:
        return _torch_sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            **({"enable_gqa": enable_gqa} if enable_gqa else {}))
    heads_axis = query.dim() == 4
    q, k, v = (x.transpose(1, 2) if heads_axis else x.unsqueeze(2) for x in (query, key, value))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    window = None
    if is_causal and seqlen_q <= seqlen_k:  # keys past seqlen_q are seen by no query: top-left = bottom-right
        k, v = k[:, :seqlen_q], v[:, :seqlen_q]
    elif is_causal:
        window = (None, seqlen_q - seqlen_k)  # key j for query i when j <= i
    out = attention(q, k, v, causal=is_causal and window is None, scale=scale, window=window, dropout_p=dropout_p)
    return out.transpose(1, 2) if heads_axis else out.squeeze(2)
