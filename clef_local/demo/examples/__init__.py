"""Example SystemOne requests shipped with the package (`clef-local decide --example NAME`)."""
