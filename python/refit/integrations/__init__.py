"""Framework integrations (filled in below)."""
