"""clef_local.export.onnx: ``clef-local export-onnx`` — the backbone as an ONNX graph, validated against torch."""
