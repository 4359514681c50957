"""Runs a checked problem's forward or backward on chosen kernel families (the planner's
policy.families), or on one given instantiation: for the GPU tests that check a family beside the
one a call takes by default."""

import dataclasses

from cupyflash.dispatch import plan, policy
from cupyflash.runtime import launch

HOPPER = ("sm90-ws", "sm90-tma", "sm90")
TENSOR_CORES = HOPPER + ("sm80",)
MMA_SYNC = ("sm80",)
SCALAR = ("scalar",)


def _policy(families):
    current = policy.current()
    return current if families is None else dataclasses.replace(current, families=tuple(families))


def forward(p, q, k, v, out, lse, families=None, kernel=None):
    launch.run(plan.plan_forward(p, q, k, v, out, lse, policy=_policy(families), kernel=kernel))


def backward(p, dout, q, k, v, out, lse, dq, dk, dv, families=None, kernel=None):
    launch.run(plan.plan_backward(p, dout, q, k, v, out, lse, dq, dk, dv, policy=_policy(families), kernel=kernel))
