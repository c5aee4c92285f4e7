"""The Kubernetes objects of a MultiWorld: their bodies (`bodies`, `ports`), the Service and
NetworkPolicy kept as the spec wants (`networking`), and pods as observed (`observe`) and cached
(`pod_cache`).
"""
