"""How a converted module captures its model, at conversion and at every later capture: the
recipe its cache calls back (``capture_recipe``), and the capture and passes it runs for each
mode (``rewrite``)."""

from .capture_recipe import CaptureRecipe, converted_module

__all__ = ["CaptureRecipe", "converted_module"]
