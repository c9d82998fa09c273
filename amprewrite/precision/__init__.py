"""Which ops need fp32: the converted graph and an fp64 reference run node for node
(``shadow``), the per-op and per-gradient error report (``compare``), and the search for the
fewest fp32 overrides that meet a tolerance (``search``)."""
