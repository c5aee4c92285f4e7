"""The operator's Prometheus metrics: what they count and read (`registry`), their server
(`server`) and who may read them (`access`).
"""
