"""Every tuning threshold and environment switch of the planner, read once into a `Policy`.

The planner (plan.py) takes its decisions from a Policy and nothing else: `current()` is the
process's, read from the environment at first use; `override(**changes)` replaces fields for the
code inside a `with` block (this thread and the tasks it starts), which the tests and benchmarks
use to run one kernel family or another. What each number rests on: docs/performance.md.

Environment switches (read once, at the first call):
    CUPYFLASH_FLOAT32_PRECISION=highest|high|medium
                                  float32's precision (default "highest"; `set_float32_precision`)
    CUPYFLASH_HOPPER_FORWARD=0    no Hopper (wgmma) forward: the mma.sync kernels, as on other GPUs
    CUPYFLASH_HOPPER_BACKWARD=0   no Hopper dK/dV kernel
    CUPYFLASH_HOPPER_TMA=0        no TMA builds (forward and backward): their cp.async twins
    CUPYFLASH_HOPPER_WS=0         no warp-specialised forward
    CUPYFLASH_HOPPER_WS_BWD=0|1   the warp-specialised dK/dV kernel for no problem / every problem
                                  a TMA build serves (unset: by the rules below)
    CUPYFLASH_WS_DQ_RING_SLABS=n  the dQ ring's slots, forced (tests: 1 or 2, so that every slab
                                  waits for the one before)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os

from cupyflash.catalog import tiles


def check_float32_precision(precision, name: str = "precision") -> str:
    if not isinstance(precision, str) or precision not in tiles.FLOAT32_PRECISIONS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, tiles.FLOAT32_PRECISIONS))}, not {precision!r}")
    return precision


@dataclasses.dataclass(frozen=True)
class Policy:
    # --- float32's precision (tiles.FLOAT32_PRECISIONS): "highest", CUDA cores, by default, as
    # PyTorch's matmuls. "high" (3xTF32) keeps the forward's results within float32's rule, but
    # gradients taken from them passed it on 3 of 120 random problems (docs/performance.md).
    float32_precision: str = "highest"

    # --- switches (environment)
    hopper_forward: bool = True
    hopper_backward: bool = True
    tma: bool = True
    ws_forward: bool = True
    ws_backward: bool | None = None  # None: by ws_backward_max_density / ws_backward_unmasked_max_seqlen_q
    # The kernel families the planner may take (catalog.FAMILIES' names): all of them, unless a test
    # or a benchmark runs one on its own (("scalar",): the CUDA-core kernels for every dtype).
    families: tuple = ("sm90-ws", "sm90-tma", "sm90", "sm80", "scalar")

    # --- the warp-specialised forward. At d64 it loses to the TMA build (three one-warpgroup blocks
    # per SM) where query tiles walk many key blocks, and wins where they walk few: it serves d64
    # only for block masks whose tiles walk at most this many key blocks on average.
    ws_forward_max_steps: tuple = ((64, 4.0),)

    # --- the warp-specialised dK/dV kernel: block masks up to this density, unmasked problems up to
    # this many queries (d64: from 512 queries on its dQ ring paces short launches), by padded head dim.
    ws_backward_max_density: tuple = ((64, 0.3), (128, 1.0))
    ws_backward_unmasked_max_seqlen_q: tuple = ((64, 384), (128, math.inf))

    # --- its dQ ring: at these head dims, where a key block walks at least ring_min_steps query
    # blocks on average (its rounding then hides behind the slab's products), up to ring_bytes of
    # slots; ring_slabs > 0 forces the number of slots. A stream keeps a ring of at most
    # ring_kept_bytes between calls; larger ones are allocated and cleared per call.
    ring_head_dims: tuple = (64,)
    ring_min_steps: float = 4.0
    ring_bytes: int = 24 << 20
    ring_slabs: int = 0
    ring_kept_bytes: int = 64 << 20

    # --- KV-cache decoding's split of the keys over blocks: no split once the blocks fill this much of
    # a wave, or below this many key tiles; otherwise the fewest splits within this much of the
    # shortest critical path, each split keeping at least min_tiles tiles.
    decode_full_wave: float = 0.8
    decode_min_key_tiles: int = 8
    decode_path_slack: float = 1.05
    decode_min_tiles_per_split: int = 4

    def __hash__(self) -> int:  # (the planner keys its decisions on the policy, on every call)
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(dataclasses.astuple(self))

    @classmethod
    def from_environment(cls, environ=None) -> Policy:
        env = os.environ if environ is None else environ
        return cls(
            float32_precision=check_float32_precision(env.get("CUPYFLASH_FLOAT32_PRECISION", "highest"),
                                                      "CUPYFLASH_FLOAT32_PRECISION"),
            hopper_forward=env.get("CUPYFLASH_HOPPER_FORWARD", "1") != "0",
            hopper_backward=env.get("CUPYFLASH_HOPPER_BACKWARD", "1") != "0",
            tma=env.get("CUPYFLASH_HOPPER_TMA", "1") != "0",
            ws_forward=env.get("CUPYFLASH_HOPPER_WS", "1") != "0",
            ws_backward={"0": False, "1": True}.get(env.get("CUPYFLASH_HOPPER_WS_BWD", "")),
            ring_slabs=int(env.get("CUPYFLASH_WS_DQ_RING_SLABS", "0")),
        )

    def ws_forward_steps(self, padded_head_dim: int) -> float | None:
        """The most key blocks a tile may walk at this head dim for the warp-specialised forward to
        serve it (None: no bound)."""
        return dict(self.ws_forward_max_steps).get(padded_head_dim)

    def ws_backward_for(self, padded_head_dim: int, density: float | None, seqlen_q: int) -> tuple[bool, str]:
        """Whether the warp-specialised dK/dV kernel serves a problem (density None: no block mask),
        and why (for explain)."""
        if self.ws_backward is not None:
            return self.ws_backward, f"CUPYFLASH_HOPPER_WS_BWD={int(self.ws_backward)}"
        if density is None:
            most = dict(self.ws_backward_unmasked_max_seqlen_q).get(padded_head_dim, 0)
            return seqlen_q <= most, f"unmasked, seqlen_q {seqlen_q} {'<=' if seqlen_q <= most else '>'} {most}"
        most = dict(self.ws_backward_max_density).get(padded_head_dim, 0.0)
        return density <= most, f"mask density {density:.3g} {'<=' if density <= most else '>'} {most}"


_CURRENT: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("cupyflash_policy", default=None)
_FROM_ENVIRONMENT: list = []  # the process's policy, read at first use


def current() -> Policy:
    """The policy in force: an override's, or the process's (read from the environment once)."""
    policy = _CURRENT.get()
    if policy is not None:
        return policy
    if not _FROM_ENVIRONMENT:
        _FROM_ENVIRONMENT.append(Policy.from_environment())
    return _FROM_ENVIRONMENT[0]


def set_process_policy(**changes) -> None:
    """Replaces fields of the process's policy (an override in force keeps its own)."""
    if not _FROM_ENVIRONMENT:
        _FROM_ENVIRONMENT.append(Policy.from_environment())
    _FROM_ENVIRONMENT[0] = dataclasses.replace(_FROM_ENVIRONMENT[0], **changes)


@contextlib.contextmanager
def override(**changes):
    """`with override(tma=False): ...` runs its block under the current policy with these fields
    replaced."""
    token = _CURRENT.set(dataclasses.replace(current(), **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
