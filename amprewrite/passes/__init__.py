"""The graph rewrite, one idempotent pass per module: split composites (``decompose``), decide
each op's precision (``classify``), make every decision an explicit cast (``insert_casts``),
remove the casts that cannot change a bit (``eliminate_casts``), fit fp32 constants
(``fit_constants``), call eager code's kernels where tracing took a library's slower fallback
(``native_kernels``), gather weight reads (``gather_weights``); ``pipeline`` runs them in order
and ``opt_levels`` builds O0, O2 and O3 on top."""
