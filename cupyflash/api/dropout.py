"""`dropout_mask`: the keep mask that attention's dropout applies, materialised."""

from __future__ import annotations

from cupyflash import validation
from cupyflash.catalog import params as structs
from cupyflash.catalog.specs import DropoutMaskKernel
from cupyflash.cpu import philox
from cupyflash.runtime import device as devices
from cupyflash.runtime import launch, params


def dropout_mask(batch, heads, seqlen_q, seqlen_k, *, dropout_p, seed, offset=0, device=None):
    """The keep mask Z that attention with ``dropout_p, seed, offset`` applies: True where the
    probability P[b, h, i, j] is kept (and scaled by 1 / (1 - dropout_p)), False where dropped.

    Materialises what the kernels regenerate tile by tile, for tests and for checking a small
    problem: ``out = (softmax(S) * Z / (1 - dropout_p)) @ V`` per (batch, head). Element (i, j) of
    (b, h) depends on (seed, offset, b, h, i, j) only, not on the sequence lengths, so the mask of
    a shorter problem is a corner of a longer one's, and a variable-length batch's sequence b has
    ``dropout_mask(...)[b, :, :len_q, :len_k]``. With GQA/MQA, h is the query head.

    Parameters
    ----------
    batch, heads, seqlen_q, seqlen_k : int
        The attention problem's sizes (heads: query heads).
    dropout_p, seed, offset : as `attention`.
    device : bool, optional
        True: generated on the GPU by the kernels' own code, returned as a CuPy array; False:
        by the NumPy mirror of that generator (the same bits), returned as NumPy; None
        (default): the GPU when one is available.

    Returns
    -------
    bool array of shape (batch, heads, seqlen_q, seqlen_k).

    Example
    -------
    >>> import cupyflash
    >>> keep = cupyflash.dropout_mask(1, 2, 3, 5, dropout_p=0.25, seed=7, device=False)
    >>> keep.shape, keep.dtype
    ((1, 2, 3, 5), dtype('bool'))
    """
    sizes = [validation.check_count(x, name) for x, name in
             ((batch, "batch"), (heads, "heads"), (seqlen_q, "seqlen_q"), (seqlen_k, "seqlen_k"))]
    if max(sizes[:2]) > validation.MAX_GRID_YZ:
        raise ValueError(f"batch and heads must each be at most {validation.MAX_GRID_YZ}, got {sizes[0]}, {sizes[1]}")
    dropout_p, seed, offset = validation.check_dropout_args(dropout_p, seed, offset)
    if device is not None:
        device = validation.check_flag(device, "device")
    on_gpu = devices.gpu_available() if device is None else device
    if not on_gpu:
        return philox.keep_mask_numpy(*sizes, dropout_p, seed, offset)
    devices.require_gpu("dropout_mask(device=True)")
    import cupy

    keep = cupy.empty(sizes, dtype=cupy.uint8)
    if keep.size:
        kernel = DropoutMaskKernel()
        fields = dict.fromkeys(structs.FWD_PARAMS_DTYPE.names, 0)
        fields.update(o=keep.data.ptr, heads=sizes[1], seqlen_q=sizes[2], seqlen_k=sizes[3], dropout_seed=seed,
                      dropout_offset=offset, dropout_threshold=philox.threshold(dropout_p),
                      dropout_rescale=philox.rescale(dropout_p))
        launch.launch(kernel, keep.device.id, kernel.grid(*sizes), params.image(structs.FWD_PARAMS_DTYPE, fields))
    return keep.view(cupy.bool_)
