"""A run's settings, above the methods and torch-free: the field table, recipes and the frozen config."""
