"""How bytes move: gradient buckets, async all-reduce handles, wire formats, link emulation.

Wire formats: :mod:`~distoptim.comm.wire` (the registry and its one spelling),
:mod:`~distoptim.comm.codecs` (encode/decode), :mod:`~distoptim.comm.feedback` (error
feedback), the averaging schemes :mod:`~distoptim.comm.averaging` (interface, SUM all-reduce),
:mod:`~distoptim.comm.quantize` (two-phase mean), :mod:`~distoptim.comm.gather`
(gather-and-sum), and :mod:`~distoptim.comm.compression` (the casts a SUM all-reduce carries).
The schemes' collectives go through a :mod:`~distoptim.comm.channel` (the members of a round
and the divisor of its mean). What replicas compare of their optimizers:
:mod:`~distoptim.comm.hyperparameters`.
"""
