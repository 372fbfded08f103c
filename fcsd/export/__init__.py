"""Exporting converted checkpoints: folders that load with and without fcsd, checked by reloading them."""
