"""Simulation on recorded traces: the timing-free replay, the timed simulator, and the what-if tables
that ask it. Both drive the runtime's own expert cache.
"""
