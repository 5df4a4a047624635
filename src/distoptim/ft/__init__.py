"""Fault tolerance on torchft: replicas that die and join mid-run, healed live from a peer.

Placeholder docstring: replaced when the package is complete.
"""
