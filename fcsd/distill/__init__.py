"""FCSD self-distillation (paper Sec. 3.1, 5.1): losses and objectives, data and packing, the two models, the
training loop and its optimisation, checkpoints, the teacher cache, MBPP+ early stopping, the sweep, and the
no-training damage probe (paper Fig. 3)."""
