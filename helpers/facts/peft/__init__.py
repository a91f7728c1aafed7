"""peft facts, one module per part of the guide (see helpers.facts)."""
