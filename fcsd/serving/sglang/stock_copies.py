"""An export as a stock checkpoint that SGLang's own classes serve right (the negative control of the serving tests,
the ``none`` variant of the prefill benchmark and of the GPU check): :func:`fcsd.serving.variants.stock_copy`, its
head written out when tied (SGLang's Qwen3-MoE never ties: a tied checkpoint gets a head of zeros, token 0
everywhere) and the fields SGLang's DeepSeek reads that transformers 5 configs leave out."""

from __future__ import annotations

import json
from pathlib import Path

from fcsd.serving.sglang.exported_configs import stock_fields
from fcsd.serving.variants import stock_copy


def sglang_stock_copy(export: Path, out: Path) -> Path:
    folder = stock_copy(Path(export), Path(out))
    config = json.loads((folder / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        from safetensors.torch import load_file, save_file

        files = sorted(folder.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"{export}: writing out a tied head needs one safetensors file, found {len(files)}")
        state = load_file(str(files[0]))
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        save_file(state, str(files[0]), metadata={"format": "pt"})
        config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps({**stock_fields(config["model_type"]), **config}, indent=2))
    return folder
