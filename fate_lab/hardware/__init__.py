"""Hardware facts in one place: links, host CPUs, device compute profiles, published models and named setups;
weight formats, llama.cpp's placements, host specs, disks and engines as data; the static speed model.

Pure data and formulas: nothing here runs a model, moves a byte or reads a clock.
"""
