"""Benchmarks for loka: the LRM model zoo, synthetic data and the training harness."""
