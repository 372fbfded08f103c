"""Serving engines for FarSkip exports (paper Sec. 4.2, 6.2; design §7): fcsd plugs FarSkip connectivity into the
engines' own model classes. Nothing here imports the rest of fcsd, so each engine's plugin runs in the engine's own
environment (its pinned torch and transformers)."""
