"""The joint schema head (docs/format.md §4) on three engines, side by side and laid out alike: :mod:`.torch_head`
(the torch backend and training), :mod:`.mlx_head` (the MLX backend) and :mod:`.numpy_head` (the ONNX Runtime
backend, no torch). Each has ``load_head(release)``, a head called as ``head(hidden, mask, lexical, layout)``, and
its ``read`` / ``logits`` steps; ``tests/test_heads.py`` holds them to one set of numbers."""
