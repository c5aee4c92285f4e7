"""The API calls the operator makes (`api`), what they share without importing kubernetes
(`api_basics`), and the calls on a Secret that several replicas race to make (`raced_secret`).
"""
