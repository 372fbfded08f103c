"""Exporting converted checkpoints: folders that load with and without fcsd, checked by reloading them."""


class ExportError(ValueError):
    """An export that cannot be written, or whose reloaded copy does not match the model."""
