"""The version, in a module of its own: the workers' handshake reads it without importing the package."""
__version__ = "0.1.0"
