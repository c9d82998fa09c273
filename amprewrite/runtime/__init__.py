"""What a converted graph calls while it runs, by name in ``gm.code``: guarded casts
(``functions``), the weight table that reads every tensor of a forward (``weight_table``), the
cache of weight casts (``weight_cache``), how long kept copies may be reused (``kept_copies``, with the
count of optimizer steps in ``optimizer_steps``), O2's stored low-precision copies
(``low_copies``), the kernels eager code runs where tracing took a library's fallback
(``native_kernels``), ``nn.MultiheadAttention`` as eager autocast runs it (``attention``),
fp8's scaled matmuls (``fp8``), and the one "is this being traced?" predicate (``tracing``)."""
