"""Environments: multi-turn episodes (model turn, environment turn, ...) with tools, by protocol."""
