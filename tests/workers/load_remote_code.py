"""Worker for test_export: load exported folders with trust_remote_code while fcsd cannot be imported, write logits."""

import sys

sys.modules["fcsd"] = None  # any `import fcsd` in the remote code fails

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

batch = torch.load(sys.argv[1])
results = {}
for folder in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    runner = getattr(model, "language_model", model)  # Llama-4's multimodal forward fails on text-only input
    with torch.no_grad():
        results[folder] = runner(input_ids=batch).logits
torch.save(results, sys.argv[2])
