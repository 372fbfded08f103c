"""Worker for test_composite: load a composite (multimodal) export with trust_remote_code while fcsd cannot be
imported, through the image-text auto class; write its class, text and image logits and a generation from an image."""

import sys

sys.modules["fcsd"] = None  # any `import fcsd` in the remote code fails

import torch  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

inputs = torch.load(sys.argv[1])
model = AutoModelForImageTextToText.from_pretrained(sys.argv[3], trust_remote_code=True).eval()
with torch.no_grad():
    results = {
        "class": type(model).__mro__[1].__name__,  # the stock class the remote code subclasses
        "text": model(input_ids=inputs["text"]).logits,
        "image": model(input_ids=inputs["image"], pixel_values=inputs["pixel_values"]).logits,
        "generated": model.generate(
            input_ids=inputs["image"], pixel_values=inputs["pixel_values"], max_new_tokens=4, do_sample=False
        ),
    }
torch.save(results, sys.argv[2])
