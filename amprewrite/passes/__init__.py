"""The graph rewrite, one idempotent pass per module: drop ops that give back what is there
(``drop_noops``), split composites (``decompose``), decide each op's precision (``classify``,
over the ops of ``op_nodes``), make every decision an explicit cast (``insert_casts``, re-running
the nodes of ``propagation``), make fp8 matmuls under ``Policy.fp8`` (``fp8``), fit fp32
constants (``fit_constants``), remove the casts that cannot change a bit (``eliminate_casts``),
compute constant subgraphs once (``fold_constants``), call eager code's kernels where tracing
took a library's slower fallback (``native_kernels``), gather weight reads
(``gather_weights``); ``pipeline`` is the one schedule that runs them in order, and
``opt_levels`` builds O0, O2 and O3 on it. Beside the schedule: the ranges of calibration
inputs (``calibrate``) and ``nn.MultiheadAttention``'s fused path (``attention``)."""
