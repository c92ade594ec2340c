"""Replica groups that survive each other's loss, on torchft: the options, torchft set up quiet, the
lighthouse reached, the quorum and its guarded collectives, one fault-tolerant round, the
synchroniser over rounds that every fault-tolerant sync mode shares, the end of a run, and the two
modes' synchronisers (every step, DiLoCo)."""
