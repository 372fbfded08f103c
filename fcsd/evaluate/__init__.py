"""Evaluation: lm-eval suites and reports (paper Table 1), MBPP+ scoring with evalplus (early stopping), exact match on
the demo tasks."""
