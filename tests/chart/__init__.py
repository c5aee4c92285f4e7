"""The chart's tests: rendered with real Helm, its CRD copy, its metrics and dashboard, the Dockerfile."""
