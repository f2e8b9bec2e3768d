"""The refusal codes of :class:`~fusion.fuse_sdpa.FuseSDPA` (family ``attention``)."""

from __future__ import annotations

import enum


class SDPACode(enum.StrEnum):
    """Why FuseSDPA left a candidate alone (the report's ``refused[].code``; the codes every
    pass shares are :class:`fusion.base.Code`)."""

    #: The Softmax of the scores is not over their last axis (the keys).
    SOFTMAX_AXIS = "softmax_axis"
    #: Between Q @ K^T and the Softmax, an op that is no constant scale, mask or bias; a mask
    #: scaled with the scores; a boolean mask beside another mask or bias.
    SCORES_FORM = "scores_form"
    #: The scores are scaled by a constant of several values that varies along another axis than
    #: the heads' (a constant per head moves into Q): the op's scale is one number.
    SCALE_NOT_SCALAR = "scale_not_scalar"
    #: The scale is zero, negative or not finite (ONNX Runtime's kernel requires scale > 0), or
    #: a head's scale is not finite.
    SCALE_NOT_POSITIVE = "scale_not_positive"
    #: A mask that the op would apply otherwise than the model: a row masked at every key (the
    #: op's zeros, the model's NaN or mean of the values), or a fill that leaves a weight.
    MASK_NOT_EXACT = "mask_not_exact"
    #: Batch times heads below the CPU provider's intra-op threads: ONNX Runtime's CPU kernel
    #: of ``Attention`` runs one thread per batch and head, the MatMuls it would replace use
    #: every thread (measured slower).
    FEW_HEADS = "few_heads"
    #: YOLO's transposed attention (``q^T @ k``, ``v @ attn^T``) where the policy's provider
    #: leaves it (the CPU's): ``Attention`` of it needs Q, K, V and its output transposed,
    #: copies that the MatMuls, which ONNX Runtime fuses with the Transposes, do not make.
    TRANSPOSED_FORM = "transposed_form"
