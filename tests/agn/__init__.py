"""Tests of distoptim.agn (parameter-server optimizers)."""
