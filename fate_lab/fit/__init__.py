"""Fitting: what runs a model to produce data files and profiles -- the embedded models' training, the draft,
the learned probes, the expert similarity table, and this machine's compute profile."""
