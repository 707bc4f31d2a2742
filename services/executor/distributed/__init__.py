"""Tensor parallelism: one executor drives a group of ranks, one process per GPU (group.py:
the process group and its collectives; layers.py: the sharded projections, embedding and LM
head; steps.py: rank 0's step tables, broadcast to the other ranks; follower.py: the loop
those ranks run; ranks.py: starting and watching them)."""
