"""Training joint schema heads on a frozen backbone (``clef-local train-head``): the full method, the question path
and the state path, their data, caches and losses. Only the demo model's head is trained here."""
