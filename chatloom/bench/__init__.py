"""Workloads and benchmarks, shared by the CLI and the tests."""
