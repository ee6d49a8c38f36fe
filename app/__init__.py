"""clef_local.app: the Gradio UI (installed as clef_local.app); it calls only the public Python API."""
