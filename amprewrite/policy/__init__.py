"""Which op computes in which precision: the :class:`~.policy.Policy` (``policy``), the op
tables it reads (``tables``: data, mirrored from ``torch.autocast``), what a device's kernels
take in low precision (``kernels``), one canonical op name per node (``opkey``), the rules
for fp8 linears (``fp8``), and the process-wide registry of user functions (``registry``). Depends on nothing else of the package."""
