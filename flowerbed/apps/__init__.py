"""Flower entry points: the ServerApp and the ClientApp (thin; the logic lives in the package)."""
