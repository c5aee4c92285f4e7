"""The spec, its limits and the CRD."""
