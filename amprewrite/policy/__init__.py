"""Which op computes in which precision: the :class:`~.policy.Policy`, the op tables it reads
(data, mirrored from ``torch.autocast``), one canonical op name per node, and the process-wide
registry of user functions. Depends on nothing else of the package."""
