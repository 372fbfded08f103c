"""Evaluation: the no-training damage probe (paper Fig. 3), lm-eval suites and reports (Table 1), MBPP+ scoring
with evalplus (early stopping), exact match on the demo tasks."""
