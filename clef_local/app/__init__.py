"""The Gradio desktop app (docs/ui.md); it calls only the public Python API."""
