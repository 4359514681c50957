"""cupyflash attention as a differentiable PyTorch function.

    import cupyflash.torch
    out = cupyflash.torch.attention(q, k, v, causal=True)   # q, k, v: torch tensors
    out.sum().backward()                                     # runs cupyflash.attention_backward

Tensors have the layout of `cupyflash.attention`: (batch, seq, heads, head_dim); a
(batch, heads, seq, head_dim) tensor passes as ``x.transpose(1, 2)`` without a copy. CUDA tensors
are read in place, the kernels run on PyTorch's current stream of their device, and the results
are allocated by torch's caching allocator (as its own operators' are). CPU tensors take
`cupyflash.attention`'s host path. The dense, varlen and decode calls are torch.library operators
(below), so torch.compile traces them; `attention_decode` declares its writes to the caches.
What the operators run on the tensors (prepared calls, torch's streams) is torch_calls.py.
Importing this module imports torch, which cupyflash does not otherwise need.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import torch

from cupyflash.api import decode
from cupyflash.frameworks import torch_calls as calls
from cupyflash.problem import Options

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_decode",
           "scaled_dot_product_attention", "FlashAttentionFunction", "FlashAttentionVarlenFunction"]

# torch's own SDPA, taken when this module is imported: what scaled_dot_product_attention hands on
# the calls its kernels do not take, also after a program has set
# torch.nn.functional.scaled_dot_product_attention to it (looked up at call time, it found itself
# and recursed without end).
_torch_sdpa = torch.nn.functional.scaled_dot_product_attention


def attention(
    q, k, v, *, causal=False, scale=None, deterministic=False, block_mask=None, window=None, softcap=None,
    alibi_slopes=None, seqlens_k=None, dropout_p=0.0, seed=None, offset=0, return_lse=False,
):
    """`cupyflash.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
    alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, dropout_p=dropout_p, seed=seed, offset=offset)`
    for torch tensors (k, v with fewer heads for GQA/MQA), with a backward pass
    (`cupyflash.attention_backward`) for autograd. `deterministic=True` makes the gradients bitwise
    reproducible (see attention_backward). With a `cupyflash.BlockMask` as block_mask,
    `cupyflash.block_sparse_attention` and its backward. The ALiBi slopes (a tensor or array) get
    no gradient. seqlens_k (a padded batch's keys: entry b uses its first seqlens_k[b]) as an int32
    CUDA tensor on q's device is read by the kernels in place, never read back (torch.compile and
    CUDA graphs take it); a host tensor, an int or a list is checked on the host; the padding
    keys' gradients are 0. With dropout_p > 0 and no seed, the seed and offset come from torch's
    generator of q's device (`torch.cuda.manual_seed` makes CUDA calls reproducible, `torch.manual_seed` CPU
    ones), whose offset each call advances, as flash-attn draws its Philox state; the backward
    reuses them. Returns out, or (out, lse) with return_lse=True (lse gets no gradient)."""
    if isinstance(alibi_slopes, torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    seqlens_k = _key_lengths(seqlens_k, q)
    args = None if block_mask is not None else _operator_args(
        q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset, deterministic, seqlens_k)
    if args is not None:  # (the operator draws an absent dropout seed itself: torch.compile traces it whole)
        out, lse, _ = _AttentionOperator.apply(*args) if _needs_grad(q, k, v) else _run(_attention_forward, *args)
    else:
        seed, offset = dropout_seed(dropout_p, seed, offset, q)
        options = Options(causal=causal, scale=scale, deterministic=deterministic, block_mask=block_mask,
                          window=window, softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k,
                          dropout_p=dropout_p, seed=seed, offset=offset, return_lse=True)
        out, lse = _eager(FlashAttentionFunction.apply)(q, k, v, options)
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
    seed, offset = dropout_seed(dropout_p, seed, offset, q)
    args = _operator_args(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset,
                          deterministic)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if (args is not None and all(isinstance(c, torch.Tensor) for c in lengths[:2])
            and all(m is None or calls.is_int(m) for m in lengths[2:])):
        args = (*args[:3], *lengths, *args[3:-1])  # (no seqlens_k: the lengths are cu_seqlens')
        out, lse = _VarlenOperator.apply(*args) if _needs_grad(q, k, v) else _run(_attention_varlen_forward, *args)
    else:
        out, lse = _eager(FlashAttentionVarlenFunction.apply)(q, k, v, *lengths, causal, scale, deterministic, window,
                                                              softcap, alibi_slopes, (dropout_p, seed, offset))
    return (out, lse) if return_lse else out


def _eager(function):
    """function run by torch.compile outside its graph (a graph break): the autograd.Function paths,
    whose host work it cannot trace."""
    return torch.compiler.disable(function, recursive=True)


def _lengths_tensor(lengths, q):
    """Per-sequence lengths given as an int (one for every sequence) or a list of ints as a host
    int32 tensor, whose values the checks then read; other values as given."""
    if isinstance(q, torch.Tensor) and q.dim() == 4 and calls.is_int(lengths, -(2**31), 2**31):
        return torch.full((q.shape[0],), lengths, dtype=torch.int32)
    if isinstance(lengths, (list, tuple)) and all(calls.is_int(n, -(2**31), 2**31) for n in lengths):
        return torch.tensor(lengths, dtype=torch.int32)
    return lengths


def _key_lengths(seqlens_k, q):
    """seqlens_k as the operators carry it: an int or a list as `_lengths_tensor` makes it, a CUDA
    integer tensor as int32 (what the kernels read); other values as given (the checks name what
    is wrong)."""
    seqlens_k = _lengths_tensor(seqlens_k, q)
    if (isinstance(seqlens_k, torch.Tensor) and seqlens_k.is_cuda and seqlens_k.dtype != torch.int32
            and not seqlens_k.is_floating_point() and not seqlens_k.is_complex() and seqlens_k.dtype != torch.bool):
        return seqlens_k.to(torch.int32)
    return seqlens_k


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


def _save(ctx, tensors: tuple, options, *non_differentiable) -> None:
    """What an autograd.Function's backward reads: the tensors, the options; and which of its
    outputs get no gradient."""
    ctx.save_for_backward(*tensors)
    ctx.options = options
    ctx.mark_non_differentiable(*non_differentiable)
    if not torch.compiler.is_compiling():
        # The gradients of the outputs without one (lse, rng_state) stay None rather than zeros
        # that autograd would allocate and fill on every backward (two launches, ~40 us a step).
        ctx.set_materialize_grads(False)


class FlashAttentionFunction(torch.autograd.Function):
    """Forward: out, lse = cupyflash.attention(...); saves q, k, v, out, lse (O(seqlen) extra) and
    returns both (lse without gradient). Backward: cupyflash.attention_backward, recomputing the
    attention matrix tile by tile. What the custom operators below do, for the calls whose options
    they cannot carry (a BlockMask, ALiBi slopes that are not a tensor, options of the wrong type,
    which the checks then name)."""

    @staticmethod
    def forward(ctx, q, k, v, options: Options):
        if options.return_lse is not True:  # (lse is saved for the backward)
            options = dataclasses.replace(options, return_lse=True)
        out, lse = calls.forward(q, k, v, options)
        _save(ctx, (q, k, v, out, lse), options, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # (out took no part in the loss)
            return None, None, None, None
        return (*calls.backward(dout, *ctx.saved_tensors, ctx.options), None)


# --------------------------------------------------------------------------- torch.library operators
#
# The dense, varlen and decode calls as torch operators (flash-attn's way since 2.7): torch.compile
# traces through them (their fake implementations give the results' shapes, dtypes and strides),
# and autograd.Functions outside them (_AttentionOperator, _VarlenOperator) call the backward
# operators. They are defined with torch.library.define/impl rather than custom_op, whose
# register_autograd wrapper cost ~150 us a call at these 14-21 arguments on torch 2.11 (its
# fill_defaults reads the schema's argument list once per argument): the forward operator alone
# took 281 us of host time a call against the autograd.Function's 111 (H200 machine). A window
# travels as two optional ints and a flag, an absent seed as None.

_LIBRARY = torch.library.Library("cupyflash", "DEF")


def _operator(function, mutates_args=()):
    """Defines cupyflash::<function's name, without its leading underscore> with the schema of its
    annotations and `function` as its implementation on CPU and CUDA tensors; returns the
    operator (an OpOverload, which `torch.library.register_fake` and opcheck take)."""
    name = function.__name__.lstrip("_")
    _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=mutates_args))
    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(name, function, key)
    operator = getattr(torch.ops.cupyflash, name).default
    if not mutates_args:  # (the dispatcher bumps a written tensor's version: decode's caches take it)
        _IMPLEMENTATIONS[operator] = function
    return operator


_IMPLEMENTATIONS: dict = {}  # operator -> its implementation, for the operators that write no tensor


def _run(operator, *args):
    """operator(*args); in plain eager mode its implementation called directly, as the dispatcher
    would on plain CPU or CUDA tensors (its way into Python and back took ~9 us a call on the H200's
    host, twice a training step). Traced by torch.compile, under a dispatch mode (FakeTensorMode,
    FlopCounterMode), under functorch transforms or with tensor subclasses, the operator itself."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active() or type(args[0]) is not torch.Tensor
            or type(args[1]) is not torch.Tensor):
        return operator(*args)
    return _IMPLEMENTATIONS[operator](*args)


def _window_args(window) -> tuple:
    if window is None:
        return False, None, None
    left, right = window
    return True, left, right


def _operator_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
                      offset, deterministic, seqlens_k=None) -> Options:
    return Options(causal=causal, scale=scale, window=(window_left, window_right) if windowed else None,
                   softcap=softcap, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, dropout_p=dropout_p, seed=seed,
                   offset=offset, deterministic=deterministic, return_lse=True)


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float], windowed: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int], offset: int, deterministic: bool,
    seqlens_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prepared = alibi_slopes is None and q.is_cuda
    if prepared and dropout_p > 0 and seed is None and torch.cuda.is_current_stream_capturing():
        # A captured call: (seed, offset) drawn on the device from torch's generator, which draws
        # afresh on each replay of the graph (as torch's own dropout under graphs); the kernels
        # read them there, and the backward reads this rng_state on the device too.
        state = torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=q.device)
        results = calls.prepared_forward(q, k, v, (causal, scale, windowed, window_left, window_right, softcap,
                                                   dropout_p), 0, 0, state, seqlens_k)
        if results is not None:
            return (*results, state)
    seed, offset = dropout_seed(dropout_p, seed, offset, q)
    if prepared:
        results = calls.prepared_forward(q, k, v, (causal, scale, windowed, window_left, window_right, softcap, dropout_p),
                                         seed, offset, None, seqlens_k)
        if results is not None:
            return (*results, _rng_state(q, dropout_p, seed, offset))
    options = _operator_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                                seed, offset, deterministic, seqlens_k)
    return (*calls.forward(q, k, v, options), _rng_state(q, dropout_p, seed, offset))


_attention_forward = _operator(_attention_forward)


def _rng_state(q, dropout_p, seed, offset) -> torch.Tensor:
    """With dropout, the seed and offset the forward drew (from torch's generator where none was
    given) as a host tensor the backward operator reads them from (a captured call's are drawn on
    the device, and stay there); without, an empty tensor on q's device (no host tensor in a graph
    that CUDA graphs capture, no copy)."""
    if dropout_p > 0:
        return torch.tensor([seed, offset], dtype=torch.int64)
    return q.new_empty((0,), dtype=torch.int64)


def _fake_rng_state(q, dropout_p) -> torch.Tensor:
    if dropout_p > 0:
        return q.new_empty((2,), dtype=torch.int64, device="cpu")
    return q.new_empty((0,), dtype=torch.int64)


@torch.library.register_fake(_attention_forward)
def _(q, k, v, causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset,
      deterministic, seqlens_k=None):
    batch, seqlen_q, heads, _ = q.shape
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=lse_type),
            _fake_rng_state(q, dropout_p))


def _attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: Optional[float], windowed: bool, window_left: Optional[int], window_right: Optional[int],
    softcap: Optional[float], alibi_slopes: Optional[torch.Tensor], dropout_p: float, rng_state: torch.Tensor,
    deterministic: bool, seqlens_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    on_device = dropout_p > 0 and rng_state.is_cuda  # (a captured forward's)
    seed, offset = (0, 0) if on_device else _drawn(dropout_p, rng_state)
    if alibi_slopes is None and q.is_cuda:
        grads = calls.prepared_backward(dout, q, k, v, out, lse, (causal, scale, windowed, window_left, window_right,
                                                             softcap, deterministic, dropout_p), seed, offset,
                                        rng_state if on_device else None, seqlens_k)
        if grads is not None:
            return grads
    if on_device:  # (the full path takes them on the host)
        seed, offset = _drawn(dropout_p, rng_state)
        offset %= 2**32
    options = _operator_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                                seed, offset, deterministic, seqlens_k)
    return calls.backward(dout, q, k, v, out, lse, options)


_attention_backward = _operator(_attention_backward)


def _drawn(dropout_p, rng_state) -> tuple:
    """(seed, offset) as the forward's `_rng_state` holds them (seed None without dropout)."""
    if not dropout_p > 0:
        return None, 0
    seed, offset = rng_state.tolist()
    return seed, offset


@torch.library.register_fake(_attention_backward)
def _(dout, q, k, v, out, lse, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AttentionOperator(torch.autograd.Function):
    """Autograd of the dense operators: the forward operator, then the backward operator on the
    saved q, k, v, out, lse, the forward's rng_state (its dropout seed and offset) and the key
    lengths (the operators' last argument)."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse, rng_state = _run(_attention_forward, q, k, v, *options)
        _save(ctx, (q, k, v, out, lse, rng_state, options[-1]), options[:-1], lse, rng_state)
        return out, lse, rng_state

    @staticmethod
    def backward(ctx, dout, _dlse, _drng):
        if dout is None:
            return (None,) * (4 + len(ctx.options))
        q, k, v, out, lse, rng_state, seqlens_k = ctx.saved_tensors
        causal, scale, windowed, left, right, softcap, slopes, dropout_p, _seed, _offset, deterministic = ctx.options
        grads = _run(_attention_backward, dout, q, k, v, out, lse, causal, scale, windowed, left, right, softcap,
                     slopes, dropout_p, rng_state, deterministic, seqlens_k)
        return (*grads,) + (None,) * (1 + len(ctx.options))


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _operator_args(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset,
                   deterministic, seqlens_k=None):
    """The dense operators' arguments for a call they can carry (seqlens_k last), else None (the
    call then takes FlashAttentionFunction, whose checks name a wrong argument)."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        return None
    if seqlens_k is not None and not isinstance(seqlens_k, torch.Tensor):
        return None
    if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2
                                   and all(w is None or calls.is_int(w) for w in window)):
        return None
    if not (isinstance(causal, bool) and isinstance(deterministic, bool) and calls.is_int(offset, 0, 2**32)
            and (seed is None or calls.is_int(seed, 0, 2**63)) and _is_float(dropout_p)
            and all(x is None or _is_float(x) for x in (scale, softcap))
            and (alibi_slopes is None or isinstance(alibi_slopes, torch.Tensor))):
        return None
    windowed, left, right = _window_args(window)
    return (q, k, v, causal, None if scale is None else float(scale), windowed, left, right,
            None if softcap is None else float(softcap), alibi_slopes, float(dropout_p), seed, offset, deterministic,
            seqlens_k)


def _is_float(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """As FlashAttentionFunction, for `cupyflash.attention_varlen` and its backward: the calls the
    varlen operators below cannot carry (cu_seqlens that are not tensors, options of other types)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, deterministic,
                window, softcap, alibi_slopes, dropout=(0.0, None, 0)):
        cu_seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        options = dict(causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                       dropout_p=dropout[0], seed=dropout[1], offset=dropout[2])
        out, lse = calls.varlen_forward(q, k, v, cu_seqlens, options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens, ctx.options = cu_seqlens, dict(options, deterministic=deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return calls.varlen_backward(dout, *ctx.saved_tensors, ctx.cu_seqlens, ctx.options) + (None,) * 11


def _varlen_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset):
    return dict(causal=causal, scale=scale, window=(window_left, window_right) if windowed else None,
                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)


def _attention_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], causal: bool, scale: Optional[float], windowed: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int], offset: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _varlen_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                              seed, offset)
    return calls.varlen_forward(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), options)


_attention_varlen_forward = _operator(_attention_varlen_forward)


@torch.library.register_fake(_attention_varlen_forward)
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    total_q, heads, _ = q.shape
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((heads, total_q), dtype=lse_type)


def _attention_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
    causal: bool, scale: Optional[float], windowed: bool, window_left: Optional[int], window_right: Optional[int],
    softcap: Optional[float], alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int], offset: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _varlen_options(causal, scale, windowed, window_left, window_right, softcap, alibi_slopes, dropout_p,
                              seed, offset)
    return calls.varlen_backward(dout, q, k, v, out, lse, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                            dict(options, deterministic=deterministic))


_attention_varlen_backward = _operator(_attention_varlen_backward)


@torch.library.register_fake(_attention_varlen_backward)
def _(dout, q, k, v, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _VarlenOperator(torch.autograd.Function):
    """Autograd of the varlen operators, as _AttentionOperator."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse = _run(_attention_varlen_forward, q, k, v, *options)
        _save(ctx, (q, k, v, out, lse), options, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * (3 + len(ctx.options))
        q, k, v, out, lse = ctx.saved_tensors
        grads = _run(_attention_varlen_backward, dout, q, k, v, out, lse, *ctx.options)
        return (*grads,) + (None,) * len(ctx.options)


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, scale=None, deterministic=False, window=None, softcap=None,
    alibi_slopes=None, seqlens_k=None, dropout_p=0.0, seed=None, offset=0,
):
    """`cupyflash.attention_backward` for torch tensors: (dq, dk, dv) of the forward's out and lse,
    on torch's current stream, through the backward operator (for a custom autograd.Function built
    from cupyflash's pieces, such as ring attention's). out and lse are used as given: the backward
    recomputes P from lse, so a merged (global) out and lse give each key block's share of the
    gradients. With dropout, pass the forward's seed and offset; seqlens_k as the forward's."""
    if isinstance(alibi_slopes, torch.Tensor):
        alibi_slopes = alibi_slopes.detach()
    seqlens_k = _key_lengths(seqlens_k, q)
    args = _operator_args(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, offset,
                          deterministic, seqlens_k)
    tensors = (dout, out, lse)
    if args is None or not all(isinstance(x, torch.Tensor) for x in tensors) or (dropout_p > 0 and seed is None):
        options = Options(causal=causal, scale=scale, deterministic=deterministic, window=window, softcap=softcap,
                          alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, dropout_p=dropout_p, seed=seed,
                          offset=offset)
        return _eager(calls.backward)(dout, q, k, v, out, lse, options)
    state = _rng_state(q, args[10], seed, offset)
    return _run(_attention_backward, dout, *args[:3], out, lse, *args[3:11], state, deterministic, seqlens_k)


def attention_decode(
    q, k_cache, v_cache, cache_seqlens=None, *, k_new=None, v_new=None, causal=False, window=None, scale=None,
    return_lse=False, num_splits=None, softcap=None, alibi_slopes=None,
):
    """`cupyflash.attention_decode` for torch tensors, as a torch operator that says it writes
    k_cache and v_cache (the append of k_new, v_new), so torch.compile traces a decoding step
    whole. cache_seqlens: an integer tensor (a CUDA one is used as given, never read back), an int,
    a list, or None. No gradient. Returns out, or (out, lse) with return_lse=True."""
    lengths = _lengths_tensor(cache_seqlens, q)
    args = _operator_args(q, k_cache, v_cache, causal, scale, window, softcap, alibi_slopes, 0.0, None, 0, False)
    carried = (args is not None and (lengths is None or isinstance(lengths, torch.Tensor))
               and all(x is None or isinstance(x, torch.Tensor) for x in (k_new, v_new))
               and (num_splits is None or calls.is_int(num_splits)))
    if not carried:  # the generic path, whose checks name a wrong argument
        return _eager(decode.attention_decode)(
            q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new, causal=causal, window=window, scale=scale,
            return_lse=return_lse, num_splits=num_splits, softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = _attention_decode(q, k_cache, v_cache, lengths, k_new, v_new, causal, args[4], *args[5:10],
                                 num_splits)
    return (out, lse) if return_lse else out


def _attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: Optional[torch.Tensor],
    k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor], causal: bool, scale: Optional[float], windowed: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: Optional[float],
    alibi_slopes: Optional[torch.Tensor], num_splits: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    if alibi_slopes is None and q.is_cuda:
        results = calls.prepared_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                   (causal, scale, windowed, window_left, window_right, softcap, num_splits))
        if results is not None:
            return results
    with calls.on_torch_stream(q):
        out, lse = decode.attention_decode(
            q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new, causal=causal,
            window=(window_left, window_right) if windowed else None, scale=scale, return_lse=True,
            num_splits=num_splits, softcap=softcap, alibi_slopes=alibi_slopes)
    return calls.as_torch(out), calls.as_torch(lse)


_attention_decode = _operator(_attention_decode, mutates_args=("k_cache", "v_cache"))


@torch.library.register_fake(_attention_decode)
def _(q, k_cache, v_cache, *options):
    batch, seqlen_q, heads, _ = q.shape
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=lse_type)


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
