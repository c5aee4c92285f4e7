"""The API calls the operator makes (`api`), what they share without importing kubernetes
(`api_basics`), the calls on a Secret that several replicas race to make (`raced_secret`), and
the interpreter made able to read JSON as deep as the API server stores (`nesting`).
"""
