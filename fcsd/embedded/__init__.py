"""The embedded default (design §9): the demo's tiny Qwen3-MoE-style teacher, its locally trained tokenizer and
synthetic chat data, built offline on first use. :mod:`fcsd.sources` resolves the names ``demo`` / ``demo-heldout``
to them; the demo *job* is :mod:`fcsd.cli.demo`."""
