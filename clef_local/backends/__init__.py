"""Backends that run the backbone and the joint schema head on a device: torch, MLX and ONNX Runtime behind one
protocol (:mod:`.base`), built by :mod:`.loader`."""
