"""Models and traces: the uniform adapter over every transformers MoE family that uses the experts interface
(`adapters`, with `routers`, `experts`, `checkpoint`, `families`), loading, the routing trace, the embedded
model's training and corpus, and tiny random models for tests.
"""
