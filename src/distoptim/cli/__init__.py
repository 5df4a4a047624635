"""The ``distoptim`` command line: train and compare the algorithms on a real dataset."""
