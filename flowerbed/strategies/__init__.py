"""Server halves of the methods, one module each; every strategy builds on ``base``."""
