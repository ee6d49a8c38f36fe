"""clef_local.export: the export pipeline (installed as clef_local.export; see DESIGN §4)."""
