"""Runners: worker pools, the engine that drives stages, and the consumer iterator."""
