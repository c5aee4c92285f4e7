"""The CLI's commands that are neither the operator nor `crd`: `run` (`multiworld run`, the local
platform) and `status` (`multiworld status`, read from the kubeconfig). `cli.py` imports each
when it runs.
"""
