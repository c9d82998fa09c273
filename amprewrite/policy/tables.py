"""Op tables: which op runs in which precision, as data.

Keys are canonical op names (see :mod:`amprewrite.policy.opkey`): the ATen overload packet name that
autocast registers (``"linear"``, ``"softmax"``, ``"conv_transpose2d"``), or
``"packet.overload"`` where one overload differs from the rest (only ``norm`` does).

The CUDA and CPU tables mirror torch 2.13's ``AutocastCUDA`` / ``AutocastCPU`` registrations
exactly (``include/ATen/autocast_mode.h`` and ``autocast_mode.cpp``), plus the sequence RNN
ops, whose kernels both backends lower beneath them (``_RNN``). ``*_COMPOSITES`` record
ops that autocast does not list but whose decomposition reaches a listed op, for a
torch-level graph node (``F.cross_entropy``) that cannot be split into its pieces.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Mapping

__all__ = ["OpCategory", "CUDA_TABLE", "CPU_TABLE", "DEFAULT_TABLE", "CUDA_COMPOSITES",
           "CPU_COMPOSITES", "O2_TABLE", "O3_TABLE", "NORM_OPS", "SAME_DTYPE_OPS"]


class OpCategory(enum.Enum):
    """What precision an op computes in under a policy."""

    LOWER = "lower"
    """Every floating input is cast to the policy's low dtype (fp16/bf16)."""
    FP32 = "fp32"
    """Every floating input is cast to fp32."""
    FP32_DTYPE_ARG = "fp32 (dtype arg)"
    """Inputs are not cast; the op's own ``dtype=`` argument is set to fp32 when unset, so it
    upcasts internally (``softmax(x_fp16, dtype=torch.float32)``): autocast's
    ``fp32_set_opt_dtype``."""
    FP32_APPEND_DTYPE = "fp32 (append dtype)"
    """``norm`` overloads without a dtype argument are redispatched to the overload with one:
    autocast's ``fp32_append_dtype``."""
    PROMOTE = "promote"
    """Floating inputs are cast to the widest floating input dtype (fp32 beats fp16/bf16)."""
    PASSTHROUGH = "passthrough"
    """Runs in whatever dtype arrives; torch's own type promotion applies."""
    MATCH_SELF = "match self"
    """Floating inputs after the first are cast to the first's dtype: an op that writes
    values into a destination tensor (``masked_scatter``, ``index_put``, ``scatter``...)
    requires them in the destination's dtype and keeps it (see :data:`SAME_DTYPE_OPS`)."""
    BANNED = "banned"
    """Unsafe in low precision: conversion raises ``AmpRewriteError``."""


def _table(**groups: str) -> Mapping[str, OpCategory]:
    out: dict[str, OpCategory] = {}
    for category, names in groups.items():
        for name in names.split():
            if name in out:
                raise ValueError(f"op {name!r} listed twice in one table")
            out[name] = OpCategory[category]
    return MappingProxyType(out)


_LOWER_COMMON = """
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
    conv_transpose3d prelu addmm matmul linalg_vecdot linear addbmm baddbmm bmm mm
"""

# The sequence RNN ops are not registered themselves, but both backends lower the kernel each
# one reaches: ``_cudnn_rnn`` on CUDA (``_cudnn_rnn_cast_reflatten`` casts input, states and
# weights to fp16) and ``mkldnn_rnn_layer`` on CPU. A captured graph keeps ``aten.lstm``
# whole, so the rule sits on it; left unlisted, a low-precision input would meet fp32 weights
# (oneDNN: "could not create a primitive descriptor for the LSTM forward propagation").
_RNN = " lstm gru rnn_tanh rnn_relu "

# CUDA: 35 lower (+ 4 RNN ops) + 59 fp32 + 11 set_opt_dtype + 2 append_dtype + 11 promote + 1 banned.
CUDA_TABLE: Mapping[str, OpCategory] = _table(
    LOWER=_LOWER_COMMON + _RNN
    + """
    convolution addmv addr einsum mv chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
    _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    _scaled_dot_product_flash_attention scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose
    """,
    FP32="""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
    softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm
    cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
    margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
    upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
    upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
    _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
    """,
    FP32_DTYPE_ARG="""
    prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum
    """,
    FP32_APPEND_DTYPE="norm.Scalar norm.ScalarOpt_dim",
    PROMOTE="""
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add
    """,
    BANNED="binary_cross_entropy",
)

# CPU: 24 lower (+ 4 RNN ops) + 100 fp32 + 3 promote; no dtype-arg, append or banned ops.
CPU_TABLE: Mapping[str, OpCategory] = _table(
    LOWER=_LOWER_COMMON + _RNN
    + """
    _addmm_activation mkldnn_rnn_layer scaled_dot_product_attention _native_multi_head_attention
    """,
    FP32="""
    avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist
    grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex
    cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
    max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d
    replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss
    nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss
    l1_loss huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits
    fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2
    fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank
    linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
    linalg_householder_product linalg_tensorinv linalg_tensorsolve
    fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
    fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
    multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
    linalg_eigh linalg_lstsq linalg_inv_ex
    """,
    PROMOTE="stack cat index_copy",
)


def _with(base: Mapping[str, OpCategory], **groups: str) -> Mapping[str, OpCategory]:
    merged = dict(base)
    merged.update(_table(**groups))
    return MappingProxyType(merged)


# Composite ops autocast does not list, whose decomposition reaches a listed op. Autocast runs
# their pieces one by one, so the presets split such a node into its ATen pieces when dtypes
# are known (DecomposeCompositesPass), which gives autocast's bits; these rules apply only to
# a node that stays whole (no example inputs), and give at least autocast's output dtype.
CUDA_COMPOSITES: Mapping[str, OpCategory] = _table(
    FP32="""
    cross_entropy_loss normalize pairwise_distance interpolate upsample_bilinear
    upsample_nearest gumbel_softmax
    """,
    FP32_DTYPE_ARG="softmin vector_norm matrix_norm norm",
    PROMOTE="grid_sample",
)
CPU_COMPOSITES: Mapping[str, OpCategory] = _table(FP32="grid_sample")

# The default policy: CUDA AMP rules on every device, except that binary_cross_entropy is
# rewritten to run in fp32 (what CPU autocast does) instead of being refused.
# Composites stay whole under the default policy: its numerics are not autocast's bits, and
# ``F.cross_entropy`` reads better in ``gm.code`` than its pieces.
DEFAULT_TABLE: Mapping[str, OpCategory] = _with(
    {**{k: v for k, v in CUDA_TABLE.items() if k != "binary_cross_entropy"}, **CUDA_COMPOSITES},
    FP32="binary_cross_entropy",
)

# Ops that write source values into a destination tensor (their first input) and refuse
# sources of another dtype ("masked_scatter: expected self and source to have same dtypes").
# No autocast table lists them, so they would pass through; where the policy's casts make
# the dtypes differ (an O2 bf16 embedding meeting fp32 image features, a value lowered by
# CUDA rules but not by CPU autocast's), the sources are cast to the destination's dtype,
# which is what the model computes in eager (the destination decides the result's dtype).
# In-place spellings (``index_put_``) share the rule. ``masked_fill``/``index_fill`` with a
# tensor value, ``where`` and the ``*_scatter`` view ops promote by themselves.
SAME_DTYPE_OPS = frozenset("""
    masked_scatter index_put _unsafe_index_put _index_put_impl scatter scatter_add
    scatter_reduce index_copy index_add index_reduce put lerp
""".split())

# Opt levels O2 and O3 (Apex's "almost fp16" and "pure fp16"): every op runs in whatever dtype
# arrives, except ops that need one dtype for all their floating inputs (matmuls, convolutions,
# attention: every op an autocast table lowers), whose inputs are cast to the low dtype, and
# the promote ops but those of SAME_DTYPE_OPS, which keep their destination's dtype, as the
# model cast to the low dtype does. O2 keeps normalisation layers in fp32; O3 runs them in
# the low dtype too.
_NORMS = """
    batch_norm instance_norm layer_norm group_norm rms_norm native_layer_norm native_group_norm
    native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional
    _native_batch_norm_legit_no_training
"""
_ONE_DTYPE = " ".join(sorted({k for t in (CUDA_TABLE, CPU_TABLE) for k, v in t.items()
                              if v is OpCategory.LOWER}))
_PROMOTE = " ".join(sorted({k for t in (CUDA_TABLE, CPU_TABLE) for k, v in t.items()
                            if v is OpCategory.PROMOTE and k != "grid_sample"
                            and k not in SAME_DTYPE_OPS}))
O2_TABLE: Mapping[str, OpCategory] = _table(LOWER=_ONE_DTYPE, FP32=_NORMS, PROMOTE=_PROMOTE)
O3_TABLE: Mapping[str, OpCategory] = _table(LOWER=_ONE_DTYPE + _NORMS, PROMOTE=_PROMOTE)
NORM_OPS = frozenset(_NORMS.split())

