"""What this machine has and what a release needs: hardware detection, the memory planner, the backend choice and
``clef-local doctor`` / ``plan``. Pure arithmetic over configs and headers: nothing here loads weights."""
