"""``fcsd plan``: what fits, how long it takes and which layers to convert, before spending GPU hours."""
