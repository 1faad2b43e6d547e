"""Model resolution and loading."""
