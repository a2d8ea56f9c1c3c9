"""Models and traces: adapters over HF MoE families, loading, the routing trace, the embedded model's
training and corpus, and tiny random models for tests.
"""
