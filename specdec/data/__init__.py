"""Training data for draft heads: chat prompts built in code (see `prompts`)."""
