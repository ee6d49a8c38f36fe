"""Backends that run the backbone (torch today; MLX and ONNX Runtime later) and feed the joint schema head."""
