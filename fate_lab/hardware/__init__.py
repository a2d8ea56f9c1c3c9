"""Hardware facts in one place: links, host CPUs, device compute profiles, published models and named setups.

Pure data and formulas: nothing here runs a model, moves a byte or reads a clock.
"""
