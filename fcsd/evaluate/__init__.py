"""Evaluation: the no-training damage probe (paper Fig. 3); lm-eval / evalplus adapters come with the eval issue."""
