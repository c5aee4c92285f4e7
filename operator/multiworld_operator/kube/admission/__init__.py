"""The validating admission webhook (`webhook`), its TLS server and caBundle (`tls`) and its
certificate, one for every replica, in a Secret (`certificate`).
"""
