"""The trained joint schema head of clef-demo-135m and its model card (package data)."""
