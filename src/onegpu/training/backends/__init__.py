"""Training backends: each trains a model on the prepared data and feeds a step recorder.

The contract and the one registry of backend names: :mod:`onegpu.training.backends.base`.
"""
