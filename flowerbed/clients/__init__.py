"""Client halves of the methods, one module each; every client builds on ``base``."""
