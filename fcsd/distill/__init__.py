"""FCSD self-distillation (paper Sec. 3.1, 5.1): losses, data, tokenizer helpers."""
