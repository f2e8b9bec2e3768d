"""The refusal codes of :class:`~fusion.merge_branches.MergeBranches` (family ``reparam``)."""

from __future__ import annotations

import enum


class ReparamCode(enum.StrEnum):
    """Why MergeBranches left a candidate alone (the report's ``refused[].code``; the codes every
    pass shares are :class:`fusion.base.Code`)."""

    #: A branch of the sum reads the block's input through an op that is no Conv, identity or
    #: BatchNorm (a ReLU in a branch).
    BRANCH_NOT_CONV = "branch_not_conv"
    #: The Conv branches have different strides, or an identity sits beside a strided Conv.
    STRIDE_MISMATCH = "stride_mismatch"
    #: The Conv branches differ in group or channels, or an identity beside Convs that change
    #: the channel count.
    GROUP_MISMATCH = "group_mismatch"
    #: The branches read different windows of the input (pads and kernels that do not line up,
    #: or auto_pad SAME).
    PADS_NOT_ALIGNED = "pads_not_aligned"
    #: The merged Conv would do more multiply-adds than the convolutions it replaces.
    MORE_WORK = "more_work"
