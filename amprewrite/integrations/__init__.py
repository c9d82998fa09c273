"""Bridges to the tools people train and deploy with; each module imports its tool, so import
the one you use (``amprewrite.integrations.onnx`` needs onnx and onnxruntime: the ``onnx``
extra; ``amprewrite.integrations.lightning``, Lightning's precision plugins, needs
lightning)."""
