"""What ran, in which dtype, with which values: the dispatch mode that records (``mode``), the
statistics it computes on device (``stats``), the FX node or module an op belongs to
(``where``), one op record and what the tables read of a report (``records``), the report
and its context manager (``report``), its tables (``tables``), static lints of a converted
graph (``lints``), the gradient histogram (``grad_hist``) and the scales and amaxes of fp8
matmuls (``fp8``)."""
