"""How bytes move: gradient buckets, async all-reduce handles, wire compression, link emulation."""
