"""Trace-driven simulation: turn streams (read from a trace file or generated), the
synthetic interactive workload, and replays of policies over them under a virtual clock.

The policies simulated are the very objects the live cache uses
(:mod:`tieredkv.policies`); the simulator only feeds them time and metadata.
"""
