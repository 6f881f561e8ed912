"""Hybrid-parallel PyTorch training runtime."""
