"""accelerate facts the guide states. Read the module docstring of helpers.facts first."""
