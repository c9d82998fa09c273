"""Training with a converted module: fp32 master weights bound to their optimizers for O2
(``master_weights``), a loss-scaler monitor (``scaler_monitor``), shared optimizer checks
(``optimizers``), and the measured memory of one training step (``memory``)."""
