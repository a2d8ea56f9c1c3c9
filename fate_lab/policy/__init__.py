"""Pure policies and the one expert cache: predictors, slot allocation, replacement, the memory
planner, the per-layer cache state machine and the layer step. No device, no thread, no clock.
"""
