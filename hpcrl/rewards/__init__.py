"""Verifiable rewards: a registry of verifiers and a pool of processes that bounds each sample's time."""
