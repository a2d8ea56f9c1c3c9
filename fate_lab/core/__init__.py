"""The driver core: the configuration, the model shape, and what every driver (runtime, simulator, replay)
builds from them through one code path."""
