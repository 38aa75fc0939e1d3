"""Exact, pure-Python models of attention: bytes, memory, FLOPs, roofline, Amdahl.

Nothing here imports torch, so the models run anywhere the shapes do.
"""
