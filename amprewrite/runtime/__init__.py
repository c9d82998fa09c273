"""What a converted graph calls while it runs, by name in ``gm.code``: guarded casts
(``functions``), the weight table that reads every tensor of a forward (``weight_table``), the
cache of weight casts (``weight_cache``), O2's stored low-precision copies (``low_copies``) and
the kernels eager code runs where tracing took a library's fallback (``native_kernels``)."""
