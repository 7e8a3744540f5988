"""Verifiable rewards: a registry of verifiers and a worker pool that bounds each sample's time."""
