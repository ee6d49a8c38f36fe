"""clef_local.quant: quantization schemes as pure tensor functions (installed as clef_local.quant)."""
