"""Placeholder: being written in this session (see the solver issue)."""
