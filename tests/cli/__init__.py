"""Tests of the distoptim command line."""
