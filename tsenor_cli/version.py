"""The package version, in a module of its own so that what reports it need not import the package's API."""

__version__ = "0.1.0"

# The distribution pip installs (pyproject.toml's project.name), named where a reader is told what to install.
DISTRIBUTION = "tsenor-cli"
