"""What a converted graph calls while it runs, by name in ``gm.code``: guarded casts
(``functions``), the weight table that reads every tensor of a forward (``weight_table``), the
cache of weight casts (``weight_cache``) and O2's stored low-precision copies (``low_copies``)."""
