"""Measuring decisions: metrics, drift between a variant and its reference, evaluation on labelled data,
temperature calibration and the HTML/Markdown reports (``eval``, ``drift``, ``calibrate``, ``report``)."""
