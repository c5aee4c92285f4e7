"""The benches' smoke tests: each bench once, with its smallest settings."""
