"""A whole run, the top layer: the composed pipeline, its hooks and sinks, resume, the output folder,
launch and verify."""
